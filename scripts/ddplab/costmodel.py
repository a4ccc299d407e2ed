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

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Link:
    """One class of link: bandwidth per direction per port (GB/s), per-message cost (µs)."""

    name: str
    gbytes_per_s: float
    alpha_us: float
    source: str


# Bandwidths are vendor line rates per direction; α are assumptions (order of magnitude of a
# small message through NCCL/verbs or a TCP socket), not measurements: the page says so.
LINKS = {
    "nvlink4": Link("NVLink 4 (H100 SXM)", 450.0, 3.0,
                    "NVIDIA H100 datasheet: NVLink 900 GB/s per GPU, both directions"),
    "ib-hdr": Link("InfiniBand HDR 200 Gb/s", 25.0, 5.0,
                   "NVIDIA ConnectX-6 / Quantum: HDR 200 Gb/s per port"),
    "ib-ndr": Link("InfiniBand NDR 400 Gb/s", 50.0, 5.0,
                   "NVIDIA ConnectX-7 / Quantum-2: NDR 400 Gb/s per port"),
    "eth-10g": Link("Ethernet 10 GbE", 1.25, 30.0, "IEEE 802.3: 10 Gb/s line rate"),
    "eth-25g": Link("Ethernet 25 GbE", 3.125, 25.0, "IEEE 802.3by: 25 Gb/s line rate"),
    "eth-100g": Link("Ethernet 100 GbE", 12.5, 20.0, "IEEE 802.3: 100 Gb/s line rate"),
}


# --8<-- [start:allreduce]
def ring_time(size: float, n: int, alpha_s: float, bytes_per_s: float) -> float:
    """Seconds for a ring all-reduce of ``size`` bytes over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * size / bytes_per_s


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
    """Buckets in the order backward fills them (DDP caps each at ``bucket_cap_mb``)."""
    full, rest = divmod(total_bytes, cap_bytes)
    return [cap_bytes] * int(full) + ([rest] if rest else [])


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


def cluster_step(compute_s: float, grad_bytes: float, gpus: int, *, link: str,
                 per_node: int = 8, nics_per_node: int | None = None, algo: str = "ring",
                 cap_bytes: float = 25 * 2**20, intra: str = "nvlink4") -> dict:
    """A step on ``gpus`` GPUs, ``per_node`` per node, nodes joined by ``link``."""
    inter = LINKS[link]
    nics = nics_per_node if nics_per_node is not None else (
        per_node if link.startswith("ib") else 1)  # rail-optimised IB: one NIC per GPU

    def allreduce(size: float) -> float:
        return hierarchical_time(size, gpus, per_node, LINKS[intra], inter, nics, algo)

    return step_time(compute_s, bucket_sizes(grad_bytes, cap_bytes), allreduce)


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
