"""Chapter 03's alpha-beta-gamma model applied to communication hooks: predicted time per hook,
and on which link compression pays.

A hook's reduction costs its all-reduces (counted: ``comm_hooks.count_bytes``) through chapter
03's model, plus its local compute (the cast, PowerSGD's matrix products), measured alone.
"""

from __future__ import annotations

from .costmodel import LINKS, parameter_buckets, ring_time, transformer_matrices

H100 = {"hbm_bytes_per_s": 3.35e12, "fp32_flops": 67e12}  # H100 SXM datasheet (HBM3, FP32)
# Memory traffic of each hook per gradient element (float32 buffer, 4 B an element):
# a cast hook reads 4 and writes 2 to cast, reads and writes 2 + 2 to divide, reads 2 and writes
# 4 to copy the sum back: 16 B.  PowerSGD adds the residual (read 4 + 4, write 4), keeps a copy
# (4 + 4), reads M for P = MQ and for Q = MᵀP (4 + 4), writes M = PQᵀ (4) and the new residual
# (read 4 + 4, write 4): 44 B, besides its 6·n·m·r flops.
CAST_BYTES_PER_ELEMENT, POWERSGD_BYTES_PER_ELEMENT = 16, 44
CAP_BYTES = 25 * 2**20          # DDP's default bucket_cap_mb
GOAL = 0.15                     # the relative error the prediction aims to stay within


# --8<-- [start:predict]
def predict_hook_ms(hook: dict, world: int, m: dict) -> float:
    """Each all-reduce the hook made (counted), through chapter 03's model, plus the hook's
    compute, measured alone."""
    comm = ring_time(hook["payload_bytes"], world, m["alpha_s"], m["bytes_per_s"],
                     m["gamma_s_per_byte"], calls=hook["calls"])
    return comm * 1e3 + hook["compute_ms"]
# --8<-- [end:predict]


def stall_range(m: dict) -> tuple[float, float]:
    """The smallest and largest ratio of chapter 03's median all-reduce to the fast calls its fit
    used, over all its sizes; (1, 1) if the run did not record medians.  Neighbouring sizes
    differ by 2x and more, so one size's ratio says little: only the range is used."""
    ratios = list((m.get("median_over_fit") or {}).values()) or [1.0]
    return min(ratios), max(ratios)


def percent_text(value: float, limit: float = GOAL) -> str:
    """``value`` as a percentage with as many decimals as it takes for the rounded number to fall
    on the same side of ``limit`` as the value itself (15.25 % is not shown as 15 %)."""
    for decimals in range(0, 6):
        text = f"{value:.{decimals}%}"
        if (abs(float(text.rstrip("%")) / 100) <= limit) == (abs(value) <= limit):
            return text
    return f"{value:%}"


def stall_band(h: dict, predicted: float, low: float, high: float) -> dict:
    """Where the measured time falls against the prediction with its communication slowed by
    chapter 03's smallest and largest stall ratio.  The hooks were not timed for stalls, so
    the run cannot say how much of the gap stalls explain; it can only say whether stalls of
    chapter 03's size could explain all of it, none of it, or too much."""
    comm = predicted - h["compute_ms"]
    band = (comm * low + h["compute_ms"], comm * high + h["compute_ms"])
    measured = h["measured_ms"]
    if measured > band[1]:
        text = (f"above the band by {measured - band[1]:.1f} ms: more than stalls of chapter "
                "03's size explain")
    elif measured < band[0]:
        text = (f"below the band by {band[0] - measured:.1f} ms: faster than even the "
                "least-stalled prediction")
    else:
        text = "inside the band: stalls of chapter 03's size could explain the gap"
    return {"with_least_stalls_ms": band[0], "with_most_stalls_ms": band[1], "band_text": text}


def prediction(hooks: dict, world: int, m: dict | None) -> dict:
    """Predicted against measured, per hook, and what the comparison says: the range of the
    errors, which hook is least off (and how much of its prediction is measured compute), and
    whether each measured time lies inside the band chapter 03's stalls span."""
    if m is None:
        return {"skipped": "no figures/chapter03/results.json: run chapter 03 first"}
    low, high = stall_range(m)
    rows = {}
    for name, h in hooks.items():
        predicted = predict_hook_ms(h, world, m)
        rel_err = (predicted - h["measured_ms"]) / h["measured_ms"]
        rows[name] = {"predicted_ms": predicted, "measured_ms": h["measured_ms"],
                      "rel_err": rel_err, "rel_err_text": percent_text(rel_err),
                      "compute_share": h["compute_ms"] / predicted if predicted else 0.0,
                      **stall_band(h, predicted, low, high)}
    return {"per_hook": rows, **error_verdict(rows), "stall_ratio_range": [low, high],
            "model": m}


def error_verdict(rows: dict) -> dict:
    errors = {name: r["rel_err"] for name, r in rows.items()}
    within = [n for n, e in errors.items() if abs(e) <= GOAL]
    direction = direction_text(list(errors.values()))
    least = min(abs(e) for e in errors.values())
    least_off = [n for n, e in errors.items() if abs(e) == least]   # every hook of a tie
    share = max(rows[n]["compute_share"] for n in least_off)
    return {"max_abs_rel_err": max(abs(e) for e in errors.values()),
            "min_rel_err": min(errors.values()), "max_rel_err": max(errors.values()),
            "min_rel_err_text": percent_text(min(errors.values())),
            "max_rel_err_text": percent_text(max(errors.values())),
            "least_off": ", ".join(least_off),
            "least_off_compute_share": share,
            "least_off_compute_text": compute_share_text(share),
            "most_off": max(errors, key=lambda n: abs(errors[n])),
            "direction_text": direction, "within_15_percent": within,
            "within_15_percent_text": ", ".join(within) if within else "none of them"}


def direction_text(errors: list[float]) -> str:
    """On which side of the measured time the predictions fall, counted (ties are 'exactly')."""
    counts = {"below": sum(e < 0 for e in errors), "above": sum(e > 0 for e in errors),
              "exactly at": sum(e == 0 for e in errors)}
    for side, n in counts.items():
        if n == len(errors):
            return f"{side} the measured time for every hook"
    parts = [f"{side} for {n}" for side, n in counts.items() if n]
    parts[0] += " hook" if parts[0].endswith(" 1") else " hooks"
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def compute_share_text(share: float) -> str:
    """What a small error is worth when ``share`` of the prediction is compute measured in the
    same run rather than modelled."""
    if share > 0.6:
        return ("most of that prediction is measured, not modelled: its small error says "
                "little about the α-β model")
    if share < 0.4:
        return "most of that prediction is modelled communication: its error tests the α-β model"
    return ("about as much of that prediction is measured compute as modelled communication: "
            "its error tests both, and does not say which")


# --- where does compression pay? --------------------------------------------------------

def billion_model(rank: int) -> dict:
    """An assumed 1 B-parameter model, its matrices in the buckets DDP really builds (a
    parameter is never split: each 256 MiB matrix is a bucket of its own)."""
    buckets = parameter_buckets(transformer_matrices(1e9), CAP_BYTES)
    shapes = [shape for bucket in buckets for shape in bucket]
    numel = sum(n * m for n, m in shapes)
    return {"parameters": numel, "matrix_shape": list(shapes[0]), "matrices": len(shapes),
            "buckets": len(buckets),
            "payload_powersgd": sum(rank * (n + m) * 4 for n, m in shapes),
            "powersgd_flops": sum(6 * n * m * rank for n, m in shapes)}


# --8<-- [start:links]
def reduction_s(sent_bytes: float, compute_s: float, world: int, link: dict,
                calls: int) -> float:
    """A hook's reduction: its all-reduces through the ring model, plus its compute."""
    return ring_time(sent_bytes, world, link["alpha_s"], link["bytes_per_s"],
                     calls=calls) + compute_s
# --8<-- [end:links]


def h100_compute_s(numel: float, rank: int) -> dict:
    """Each hook's compute on an H100, from its memory traffic and flops (assumed, see top)."""
    cast = CAST_BYTES_PER_ELEMENT * numel / H100["hbm_bytes_per_s"]
    return {"none": 0.0, "fp16": cast, "bf16": cast,
            "powersgd": (6 * numel * rank / H100["fp32_flops"]
                         + POWERSGD_BYTES_PER_ELEMENT * numel / H100["hbm_bytes_per_s"])}


def where_it_pays(hooks: dict, params: int, world: int, loopback: dict | None,
                  rank: int) -> dict:
    """Speed-up of each hook's reduction over plain fp32 averaging, per link and model, and
    per model and compute the verdict: on which links each hook pays, and the best one; and
    whether each link's verdict holds across the range of α its source allows."""
    big = billion_model(rank)
    links = link_rows(lambda link: link.alpha_us, loopback)
    low = link_rows(lambda link: link.alpha_range_us[0], loopback)
    cpu_s_per_byte = {h: hooks[h]["compute_ms"] * 1e-3 / (params * 4) for h in hooks}
    # PowerSGD on the 1 B model: torch's hook makes three all-reduces per bucket (the
    # uncompressed tensors', even when there are none, then P's and Q's).
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
    table = speedups(models, links, world, rank)
    verdict = verdicts(table, links)
    add_alpha_sensitivity(verdict, verdicts(speedups(models, low, world, rank), low), links, low)
    return {"world_size": world, "rank": rank, "links": links, "billion": big,
            "speedup": table, "verdict": verdict}


def link_rows(alpha_us, loopback: dict | None) -> dict:
    """The link table as the model reads it, α chosen by ``alpha_us(link)``; loopback first
    (chapter 03's fit: one measured α, no range), when there is a fit."""
    links = {key: {"alpha_s": alpha_us(link) * 1e-6, "bytes_per_s": link.gbytes_per_s * 1e9,
                   "name": link.name, "alpha_us": alpha_us(link),
                   "alpha_range_us": list(link.alpha_range_us)}
             for key, link in sorted(LINKS.items(), key=lambda kv: kv[1].gbytes_per_s)}
    if loopback is None:
        return links
    return {"loopback": {"alpha_s": loopback["alpha_s"], "bytes_per_s": loopback["bytes_per_s"],
                         "name": "loopback (chapter 03)"}, **links}


def speedups(models: dict, links: dict, world: int, rank: int) -> dict:
    """Per model and link: each hook's speed-up over plain averaging, with this CPU's compute
    and with an H100's, and plain averaging's time."""
    table = {}
    for model_name, mdl in models.items():
        compute = {"cpu": mdl["compute_cpu"], "h100": h100_compute_s(mdl["bytes"] / 4, rank)}
        for link_name, link in links.items():
            row = {}
            for where, spent in compute.items():
                base = reduction_s(mdl["sent"]["none"], spent["none"], world, link,
                                   mdl["calls"]["none"])
                for h in ("fp16", "bf16", "powersgd"):
                    row[f"{h}_{where}"] = base / reduction_s(mdl["sent"][h], spent[h], world,
                                                             link, mdl["calls"][h])
                row[f"none_ms_{where}"] = base * 1e3
            table.setdefault(model_name, {})[link_name] = row
    return table


def add_alpha_sensitivity(verdict: dict, at_low: dict, links: dict, low: dict) -> None:
    """Beside each link's verdict (at the table's α, the top of its range): whether the verdict
    is the same at the bottom of the range, in words."""
    for model_name, per_compute in verdict.items():
        for where, per_link in per_compute.items():
            for link_name in links:
                high, other = per_link[link_name], at_low[model_name][where][link_name]
                lo, hi = low[link_name]["alpha_s"] * 1e6, links[link_name]["alpha_s"] * 1e6
                same = (high["best_hook"] == other["best_hook"]
                        and (high["speedup"] > 1) == (other["speedup"] > 1))
                high["alpha_holds"] = same
                high["alpha_text"] = (
                    f"α {hi:.3g} µs, measured" if link_name == "loopback" else
                    f"α {hi:.3g} µs; its source gives no range" if lo == hi else
                    f"the same for α from {lo:.3g} to {hi:.3g} µs" if same else
                    f"at α {lo:.3g} µs instead: {other['text']}")


def verdicts(table: dict, links: dict) -> dict:
    """Per model, compute and link: the best hook and its speed-up, in words too; per model and
    compute: the links where PowerSGD, and where fp16, pays (speed-up above 1)."""
    out = {}
    for model_name, rows in table.items():
        for where in ("cpu", "h100"):
            verdict = {}
            for link_name, row in rows.items():
                best = max(("fp16", "bf16", "powersgd"), key=lambda h: row[f"{h}_{where}"])
                x = row[f"{best}_{where}"]
                verdict[link_name] = {
                    "best_hook": best, "speedup": x,
                    "text": (f"{HOOK_NAMES[best]} pays most, {x:.1f}×" if x > 1 else
                             f"no hook pays (the best, {HOOK_NAMES[best]}, {x:.2f}×)")}
            for h in ("fp16", "powersgd"):
                pays = [links[k]["name"] for k, row in rows.items() if row[f"{h}_{where}"] > 1]
                verdict[f"{h}_pays_on"] = "; ".join(pays) if pays else "no link of the table"
            out.setdefault(model_name, {})[where] = verdict
    return out


HOOK_NAMES = {"fp16": "fp16", "bf16": "bf16", "powersgd": "PowerSGD"}
