"""A cost model of a DDP step: compute, plus what of each bucket's all-reduce backward cannot hide.

One all-reduce of S bytes over N ranks costs (the alpha-beta model of chapter 03)

    ring:  2(N-1)·α + 2(N-1)/N · S/B        (every rank sends 2(N-1)/N·S, in 2(N-1) messages)
    tree:  2·log2(N)·α + 2 · S/B            (double binary tree, pipelined: fewer hops, ~2S bytes)

α is the cost of one message, B the bandwidth of one rank's link.  On a cluster the links
differ: GPUs in one node talk over NVLink, nodes over InfiniBand or Ethernet.  A hierarchical
all-reduce reduce-scatters inside the node, all-reduces 1/g of the data across nodes, then
all-gathers inside the node.  A step overlaps the buckets' all-reduces with backward: a bucket
starts when backward has produced it and the previous bucket is done; whatever is still running
when backward ends is exposed.  Assumptions are named where they are made.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .bucketed_ddp import assign_buckets

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Link:
    """One class of link: bandwidth per direction per port (GB/s), per-message cost (µs), and
    the range of per-message costs the cited source allows (µs, low to high)."""

    name: str
    gbytes_per_s: float
    alpha_us: float
    source: str
    alpha_range_us: tuple[float, float]


# The book's one link table (chapters 09 and 10 and their pages read it from here).
# β: vendor line rates per direction, cited per link.  α: one ring step's latency in NCCL's own
# cost model, for every row the same algorithm and protocol, Ring with Simple (the protocol of
# highest bandwidth, which NCCL's tuner favours for large messages): ``hwLat`` in nccl
# src/graph/tuning.cc.  NVLink's entry is 3.4 µs
# in every NCCL version read; the network row's ("NET", InfiniBand and sockets alike) is 14.0 µs
# in current NCCL and 9.6 µs in older releases, so α's range there is 9.6-14 µs.  Ethernet's α
# adds the kernel's TCP stack on top of NCCL's 14 µs, assumed (20-30 µs, more on slower links);
# its range reaches down to the network row's 9.6 µs: Ethernet without the kernel (RoCE, which
# NCCL drives through its InfiniBand transport).  The pages render these numbers from here.
NET_ALPHA_RANGE_US = (9.6, 14.0)
LINKS = {
    "nvlink4": Link("NVLink 4 (H100 SXM)", 450.0, 3.4,
                    "NVIDIA H100 datasheet: NVLink 900 GB/s per GPU, both directions",
                    (3.4, 3.4)),
    "ib-hdr": Link("InfiniBand HDR 200 Gb/s", 25.0, 14.0,
                   "NVIDIA ConnectX-6 / Quantum: HDR 200 Gb/s per port", NET_ALPHA_RANGE_US),
    "ib-ndr": Link("InfiniBand NDR 400 Gb/s", 50.0, 14.0,
                   "NVIDIA ConnectX-7 / Quantum-2: NDR 400 Gb/s per port", NET_ALPHA_RANGE_US),
    "eth-10g": Link("Ethernet 10 GbE", 1.25, 30.0, "IEEE 802.3: 10 Gb/s line rate",
                    (NET_ALPHA_RANGE_US[0], 30.0)),
    "eth-25g": Link("Ethernet 25 GbE", 3.125, 25.0, "IEEE 802.3by: 25 Gb/s line rate",
                    (NET_ALPHA_RANGE_US[0], 25.0)),
    "eth-100g": Link("Ethernet 100 GbE", 12.5, 20.0, "IEEE 802.3: 100 Gb/s line rate",
                     (NET_ALPHA_RANGE_US[0], 20.0)),
}


# --8<-- [start:allreduce]
def ring_time(size: float, n: int, alpha_s: float, bytes_per_s: float,
              gamma_s_per_byte: float = 0.0, calls: int = 1) -> float:
    """Seconds for ``calls`` ring all-reduces of ``size`` bytes in all over ``n`` ranks:
    2(N-1)·α per call, 2(N-1)/N·S/B on the wire, (N-1)/N·S·γ of adding (chapter 03).
    The time is affine in the size, so the calls' total size is all it needs."""
    if n <= 1:
        return 0.0
    return (2 * (n - 1) * alpha_s * calls + 2 * (n - 1) / n * size / bytes_per_s
            + (n - 1) / n * size * gamma_s_per_byte)


def tree_time(size: float, n: int, alpha_s: float, bytes_per_s: float) -> float:
    """Seconds for a pipelined (double binary) tree all-reduce: log-depth latency."""
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * alpha_s + 2 * size / bytes_per_s


def hierarchical_time(size: float, gpus: int, per_node: int, intra: Link, inter: Link,
                      nics_per_node: int, algo: str = "ring") -> float:
    """Reduce-scatter in the node, all-reduce 1/g of the data across nodes, all-gather."""
    g = min(gpus, per_node)
    nodes = math.ceil(gpus / per_node)
    a_in, b_in = intra.alpha_us * 1e-6, intra.gbytes_per_s * 1e9
    half_ring_intra = (g - 1) * a_in + (g - 1) / g * size / b_in  # reduce-scatter = all-gather
    if nodes == 1:
        return 2 * half_ring_intra
    per_gpu_net = inter.gbytes_per_s * 1e9 * nics_per_node / g  # the node's NICs, shared by g
    across = ring_time if algo == "ring" else tree_time
    return 2 * half_ring_intra + across(size / g, nodes, inter.alpha_us * 1e-6, per_gpu_net)
# --8<-- [end:allreduce]


def bucket_sizes(total_bytes: float, cap_bytes: float) -> list[float]:
    """Even buckets of ``cap_bytes``: right only for a model of many parameters each far below
    the cap (DDP never splits a parameter; ``parameter_buckets`` packs real shapes)."""
    full, rest = divmod(total_bytes, cap_bytes)
    return [cap_bytes] * int(full) + ([rest] if rest else [])


def parameter_buckets(shapes: list[tuple[int, ...]], cap_bytes: float,
                      bytes_per_element: int = 4) -> list[list[tuple[int, ...]]]:
    """The buckets DDP builds for parameters of these shapes (defined in this order), by the
    book's one packing rule: a parameter is never split, so one larger than the cap is a bucket
    of its own.  Meta tensors: shapes and sizes without memory."""
    dtype = {4: torch.float32, 2: torch.bfloat16}[bytes_per_element]
    named = [(str(i), torch.empty(shape, dtype=dtype, device="meta"))
             for i, shape in enumerate(shapes)]
    return [[tuple(p.shape) for _, p in bucket]
            for bucket in assign_buckets(named, int(cap_bytes))]


def transformer_matrices(params: float, hidden: int = 4096,
                         mlp: int = 16384) -> list[tuple[int, int]]:
    """An assumed transformer's weights as its MLP matrices, hidden × mlp and back, enough of
    them for ``params`` parameters (attention and embeddings folded into the count)."""
    count = round(params / (hidden * mlp))
    return [(mlp, hidden) if i % 2 == 0 else (hidden, mlp) for i in range(count)]


def transformer_gradient_buckets(params: float, cap_bytes: float = 25 * 2**20) -> list[float]:
    """Bytes of each bucket of an assumed transformer's gradients: float32 (DDP under autocast
    keeps gradients in the parameters' type unless a hook casts them), packed as DDP packs."""
    buckets = parameter_buckets(transformer_matrices(params), cap_bytes, bytes_per_element=4)
    return [4.0 * sum(math.prod(shape) for shape in bucket) for bucket in buckets]


def chapter03_calibration(out: Path) -> dict | None:
    """α, β and γ of chapter 03's fit of native all-reduce: the reader's run in ``out``, else
    the committed one; None if neither has them (a --quick run fits no bandwidth)."""
    for root in (Path(out), REPO / "figures"):
        fit = chapter03_fit(root)
        if fit is not None:
            return fit
    return None


def chapter03_fit(root: Path) -> dict | None:
    """The fit in ``root/chapter03/results.json``, or None if it is missing or incomplete."""
    path = Path(root) / "chapter03" / "results.json"
    try:
        r = json.loads(path.read_text())
        fit = r["alpha_beta"]["native"]
        cal = {"alpha_us": float(fit["alpha_us"]), "beta_gbps": float(fit["beta_gbps"]),
               "alpha_s": float(fit["alpha_us"]) * 1e-6,
               "bytes_per_s": float(fit["beta_gbps"]) * 1e9,
               "gamma_s_per_byte": 1e-9 / float(r["gamma_gbps"])}
    except (OSError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return None  # missing, or written by another version of chapter 03
    typical = r.get("median_ms", {}).get("native", {})  # every call, stalls included
    fast = r.get("time_ms", {}).get("native", {})       # the p10 calls the fit uses
    cal["median_over_fit"] = {size: typical[size] / fast[size]
                              for size in fast if size in typical and fast[size] > 0}
    provenance = r.get("provenance", {})
    return {**cal, "world_size": provenance.get("world_size"),
            "measured": provenance.get("date"), "device": provenance.get("device"),
            "run": run_label(root), "source": shown_path(path)}


def run_label(root: Path) -> str:
    """Whose results ``root`` holds, in words: the committed figures or the reader's run."""
    committed = Path(root).resolve() == (REPO / "figures").resolve()
    return "the committed run" if committed else "your run"


def shown_path(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (as a page shows it)."""
    where = Path(path).resolve()
    return str(where.relative_to(REPO) if where.is_relative_to(REPO) else where)


# --8<-- [start:step]
def step_time(compute_s: float, buckets: list[float], allreduce, backward_share=2 / 3) -> dict:
    """One DDP step: bucket i is ready when backward has produced its bytes (assumption:
    backward produces gradient bytes at an even rate); all-reduces run one after another."""
    forward = compute_s * (1 - backward_share)
    backward = compute_s * backward_share
    total, produced, comm_end = sum(buckets), 0.0, forward
    for size in buckets:
        produced += size
        ready = forward + backward * produced / total
        comm_end = max(comm_end, ready) + allreduce(size)
    exposed = max(0.0, comm_end - compute_s)
    step = compute_s + exposed
    return {"step_s": step, "compute_s": compute_s, "exposed_s": exposed,
            "comm_s": sum(allreduce(s) for s in buckets), "efficiency": compute_s / step}
# --8<-- [end:step]


def cluster_step(compute_s: float, grad_bytes: float | list[float], gpus: int, *, link: str,
                 per_node: int = 8, nics_per_node: int | None = None, algo: str = "ring",
                 cap_bytes: float = 25 * 2**20, intra: str = "nvlink4") -> dict:
    """A step on ``gpus`` GPUs, ``per_node`` per node, nodes joined by ``link``; the gradient
    given as its total bytes (even buckets) or as its real buckets' bytes."""
    inter = LINKS[link]
    nics = nics_per_node if nics_per_node is not None else (
        per_node if link.startswith("ib") else 1)  # rail-optimised IB: one NIC per GPU

    def allreduce(size: float) -> float:
        return hierarchical_time(size, gpus, per_node, LINKS[intra], inter, nics, algo)

    buckets = (list(grad_bytes) if isinstance(grad_bytes, list)
               else bucket_sizes(grad_bytes, cap_bytes))
    return step_time(compute_s, buckets, allreduce)


def transformer_compute_s(params: float, tokens_per_gpu: int, peak_tflops: float = 989.0,
                          mfu: float = 0.4) -> float:
    """≈ 6·P FLOPs per token (forward + backward) at ``mfu`` of an H100's dense bf16 peak."""
    return 6 * params * tokens_per_gpu / (peak_tflops * 1e12 * mfu)


def fitted_allreduce(allreduce_s: dict, world: int):
    """α and β fitted to this run's own all-reduce timings (least squares, two unknowns)."""
    sizes = np.array([float(s) for s in allreduce_s])
    times = np.array(list(allreduce_s.values()))
    messages, per_byte = 2 * (world - 1), 2 * (world - 1) / world
    design = np.column_stack([np.full_like(sizes, messages), per_byte * sizes])
    (alpha, beta), *_ = np.linalg.lstsq(design, times, rcond=None)
    alpha, beta = max(alpha, 0.0), max(beta, 1e-15)
    return lambda size: messages * alpha + per_byte * size * beta


# --8<-- [start:zero3]
def zero3_bytes_per_step(param_bytes: float, n: int, reshard_after_forward: bool = True) -> dict:
    """Bytes one rank sends per step in a ring, DDP against FSDP (ZeRO-3), for a model of
    ``param_bytes``: DDP all-reduces the gradients, 2(N-1)/N·S; FSDP all-gathers the parameters
    before forward, again before backward (unless it kept them: ZeRO-2's traffic), and
    reduce-scatters the gradients, (N-1)/N·S each."""
    half = (n - 1) / n * param_bytes
    gathers = 2 if reshard_after_forward else 1
    return {"ddp": 2 * half, "fsdp": (gathers + 1) * half, "ratio": (gathers + 1) / 2}


def fsdp_hiding_threshold(layer_params: float, n: int, *, link: str, bytes_per_param: int = 2,
                          peak_tflops: float = 989.0, mfu: float = 0.4) -> dict:
    """Tokens per rank per step above which FSDP's all-gathers hide behind compute.

    Assumptions: every unit is one layer of ``layer_params``; the next layer's all-gather is
    prefetched while this layer computes, so it hides when a layer's forward (2·P FLOPs per
    token) takes at least one all-gather of the layer; backward (4·P per token, one all-gather
    and one reduce-scatter per layer) gives the same condition; one flat ring over ``n`` ranks
    whose slowest hop is ``link`` (one NIC per GPU), at ``mfu`` of ``peak_tflops``."""
    spec = LINKS[link]
    layer_bytes = layer_params * bytes_per_param
    gather_s = ((n - 1) * spec.alpha_us * 1e-6
                + (n - 1) / n * layer_bytes / (spec.gbytes_per_s * 1e9))
    flops_per_s = peak_tflops * 1e12 * mfu
    tokens = gather_s * flops_per_s / (2 * layer_params)
    return {"gather_s": gather_s, "tokens_per_rank": tokens,
            "bandwidth_only_tokens": (n - 1) / n * bytes_per_param * flops_per_s
            / (2 * spec.gbytes_per_s * 1e9)}
# --8<-- [end:zero3]
