"""Chapter 03's alpha-beta-gamma model applied to communication hooks: predicted time per hook,
and on which link compression pays.

A hook's reduction costs its all-reduces (counted: ``comm_hooks.count_bytes``) through chapter
03's model, plus its local compute (the cast, PowerSGD's matrix products), measured alone.
"""

from __future__ import annotations

import json
from pathlib import Path

# Links (per direction).  Ethernet: IEEE 802.3 line rates.  InfiniBand HDR 200 Gb/s and NDR
# 400 Gb/s per port (NVIDIA ConnectX-6 / ConnectX-7 product briefs).  NVLink 4: 900 GB/s per
# H100 GPU, both directions together (NVIDIA H100 Tensor Core GPU datasheet).  Latencies: typical
# values, assumed (TCP over Ethernet ~20 µs, RDMA and NVLink a few µs); bandwidth dominates here.
LINKS = {"10GbE": (1.25e9, 20e-6), "25GbE": (3.125e9, 20e-6), "100GbE": (12.5e9, 15e-6),
         "IB_HDR": (25e9, 3e-6), "IB_NDR": (50e9, 3e-6), "NVLink4": (450e9, 3e-6)}
REPO = Path(__file__).resolve().parents[2]
H100 = {"hbm_bytes_per_s": 3.35e12, "fp32_flops": 67e12}  # H100 SXM datasheet (HBM3, FP32)


# --- the alpha-beta-gamma model ----------------------------------------------------------

def chapter03_model(out: Path) -> dict | None:
    """α, β, γ from chapter 03's results.json (its fit of native all-reduce), or None."""
    for path in (out / "chapter03" / "results.json",
                 REPO / "figures" / "chapter03" / "results.json"):
        try:
            r = json.loads(path.read_text())
            fit = r["alpha_beta"]["native"]
            model = {"alpha_s": fit["alpha_us"] * 1e-6, "beta_s_per_byte": 1e-9 / fit["beta_gbps"],
                     "gamma_s_per_byte": 1e-9 / r["gamma_gbps"]}
        except (OSError, KeyError, TypeError, ValueError, ZeroDivisionError):
            continue  # missing, or written by another version of chapter 03
        where = path.resolve()
        source = where.relative_to(REPO) if where.is_relative_to(REPO) else where
        return {**model, "world_size": r.get("provenance", {}).get("world_size"),
                "measured": r.get("provenance", {}).get("date"), "source": str(source)}
    return None


# --8<-- [start:predict]
def allreduce_time(size_bytes: float, world: int, alpha: float, beta: float,
                   gamma: float) -> float:
    """Chapter 03: t = 2(N-1)·α + 2(N-1)/N·S·β + (N-1)/N·S·γ  (seconds)."""
    if world < 2:
        return 0.0
    return 2 * (world - 1) * alpha + (2 * (world - 1) / world * beta
                                      + (world - 1) / world * gamma) * size_bytes


def predict_hook_ms(hook: dict, world: int, m: dict) -> float:
    """Each all-reduce the hook made, through the model, plus its compute measured alone.
    The model is affine in the size, so the calls' total size is all it needs."""
    alpha_part = hook["calls"] * allreduce_time(0, world, m["alpha_s"], 0, 0)
    size_part = allreduce_time(hook["payload_bytes"], world, 0, m["beta_s_per_byte"],
                               m["gamma_s_per_byte"])
    return (alpha_part + size_part) * 1e3 + hook["compute_ms"]
# --8<-- [end:predict]


def prediction(hooks: dict, world: int, m: dict | None) -> dict:
    if m is None:
        return {"skipped": "no figures/chapter03/results.json: run chapter 03 first"}
    rows = {}
    for name, h in hooks.items():
        predicted = predict_hook_ms(h, world, m)
        rows[name] = {"predicted_ms": predicted, "measured_ms": h["measured_ms"],
                      "rel_err": (predicted - h["measured_ms"]) / h["measured_ms"]}
    rows_err = [abs(r["rel_err"]) for r in rows.values()]
    return {"per_hook": rows, "max_abs_rel_err": max(rows_err),
            "within_15_percent": (within := [n for n, r in rows.items()
                                             if abs(r["rel_err"]) <= 0.15]),
            "within_15_percent_text": ", ".join(within) if within else "none of them",
            "model": m}


# --- where does compression pay? --------------------------------------------------------

def billion_model(rank: int) -> dict:
    """An assumed 1 B-parameter model: transformer MLP matrices 4096 × 16384 (and back)."""
    n, m = 4096, 16384
    matrices = round(1e9 / (n * m))
    return {"parameters": matrices * n * m, "buckets": -(-matrices * n * m * 4 // (25 * 2**20)),
            "payload_powersgd": matrices * rank * (n + m) * 4,
            "powersgd_flops": matrices * 6 * n * m * rank}


# --8<-- [start:links]
def hook_cost_s(sent_bytes: float, compute_s: float, world: int, bandwidth: float,
                alpha: float, calls: int) -> float:
    """Communication (ring: 2(N-1)/N of the bytes each way) + compression compute."""
    return (2 * (world - 1) * alpha * calls
            + 2 * (world - 1) / world * sent_bytes / bandwidth + compute_s)


# --8<-- [end:links]


def where_it_pays(hooks: dict, params: int, world: int, loopback: dict | None,
                  rank: int) -> dict:
    """Speed-up of each hook's reduction over plain fp32 averaging, per link and model."""
    big = billion_model(rank)
    links = {key: bw for key, bw in LINKS.items()}
    if loopback is not None:
        links = {"loopback": (1 / loopback["beta_s_per_byte"], loopback["alpha_s"]), **links}
    cpu_s_per_byte = {h: hooks[h]["compute_ms"] * 1e-3 / (params * 4) for h in hooks}
    models = {
        "this": {"bytes": params * 4, "sent": {h: hooks[h]["payload_bytes"] for h in hooks},
                 "calls": {h: hooks[h]["calls"] for h in hooks},
                 "compute_cpu": {h: hooks[h]["compute_ms"] * 1e-3 for h in hooks}},
        "1B": {"bytes": big["parameters"] * 4,
               "sent": {"none": big["parameters"] * 4, "fp16": big["parameters"] * 2,
                        "bf16": big["parameters"] * 2, "powersgd": big["payload_powersgd"]},
               "calls": {h: big["buckets"] * (3 if h == "powersgd" else 1) for h in hooks},
               "compute_cpu": {h: cpu_s_per_byte[h] * big["parameters"] * 4 for h in hooks}},
    }
    table = {}
    for model_name, mdl in models.items():
        numel = mdl["bytes"] / 4
        h100 = {"none": 0.0, "fp16": 6 * numel / H100["hbm_bytes_per_s"],
                "bf16": 6 * numel / H100["hbm_bytes_per_s"],
                "powersgd": (6 * numel * rank / H100["fp32_flops"]
                             + 12 * numel / H100["hbm_bytes_per_s"])}
        for link, (bw, alpha) in links.items():
            row = {}
            for where, compute in (("cpu", mdl["compute_cpu"]), ("h100", h100)):
                base = hook_cost_s(mdl["sent"]["none"], compute["none"],
                                   world, bw, alpha, mdl["calls"]["none"])
                for h in ("fp16", "bf16", "powersgd"):
                    cost = hook_cost_s(mdl["sent"][h], compute[h], world, bw,
                                       alpha, mdl["calls"][h])
                    row[f"{h}_{where}"] = base / cost
                row[f"none_ms_{where}"] = base * 1e3
            table.setdefault(model_name, {})[link] = row
    return {"world_size": world, "rank": rank, "links": {k: {"bytes_per_s": v[0], "alpha_s": v[1]}
                                                         for k, v in links.items()},
            "billion": big, "speedup": table}
