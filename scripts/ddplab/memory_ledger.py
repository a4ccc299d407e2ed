"""The memory ledger: what a rank holds under DDP and ZeRO-1, -2, -3, predicted and measured.

The ZeRO paper (Rajbhandari et al., SC 2020, arXiv:1910.02054, section 3.1) counts, per
parameter, for mixed-precision Adam: 2 bytes of fp16 parameter, 2 of fp16 gradient and K = 12
of optimizer state (fp32 master copy, momentum, variance); 4 + 4 + 8 in plain fp32 training.
DDP keeps all of it on every rank; ZeRO-1 splits the optimizer state N ways, ZeRO-2 the
gradients too, ZeRO-3 the parameters too (``paper_ledger``).

A real layout does not split Ψ into N equal parts, and the ledgers below say by how much:

* **ZeRO-1, ``ZeroRedundancyOptimizer`` / ``ShardedOptimizer``:** whole parameters have an owner
  (``sharded_optimizer.partition_parameters``), so a rank holds the state of the parameters it
  owns: one large layer can leave one rank with far more than Ψ/N (``zero1_ledger``).
* **ZeRO-2, ``ShardedGradients``:** flat buckets padded to a multiple of N (``zero2_ledger``).
* **ZeRO-3, FSDP2's ``fully_shard``:** every parameter cut on dim 0 by ``torch.chunk`` into
  chunks of ⌈d₀/N⌉ rows (``dim0_shard_rows``).  torch/distributed/fsdp/_fully_shard/
  _fsdp_param.py (``FSDPParam._init_sharded_param``) stores each rank's chunk zero-padded to
  ⌈d₀/N⌉ rows; the gradients are views into one reduce-scatter output per group, also padded
  (_fsdp_collectives.py, ``foreach_reduce``); the optimizer's state is made like the local
  shard, so it has only the rows the rank really holds (``zero3_ledger``).

``measure`` walks every tensor a rank holds — parameters, their gradients, the optimizer's
state — and adds up the bytes of their *storages*, each storage once: a view into a padded
buffer costs the whole buffer, padding included, and a shard that is a view of a bucket costs
nothing more.  The tests assert that the two agree to the byte.  Adam's ``step`` counter (a
0-dim float32 per parameter tensor, on the CPU unless fused or capturable: torch/optim/adam.py,
``_init_group``) is kept apart as ``counters``: the paper ignores it.  Buffers a wrapper keeps
for itself (native DDP's gradient buckets, a reduce-scatter's staging buffer) are not walked:
the profiler's peak sees them.

``profiler_peak_bytes`` reads the peak of the bytes allocated while a function runs from
``torch.profiler`` (``profile_memory=True``): the running total of its allocation events, not
its per-category labels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

import torch
from torch.optim import Optimizer
from torch.profiler import ProfilerActivity, profile

from .sharded_optimizer import partition_parameters

# Bytes per parameter: (parameters, gradients, optimizer state), ZeRO paper section 3.1.
PAPER_BYTES = {"mixed_adam": (2, 2, 12), "fp32_adam": (4, 4, 8)}
# Optimizer state per element: (fp32 tensors like the parameter, has a step counter).
STATE = {"adam": (2, True), "sgd_momentum": (1, False)}
FP32 = 4


@dataclass(frozen=True)
class Ledger:
    """Bytes one rank holds, by kind."""

    params: float = 0
    grads: float = 0
    optimizer_state: float = 0
    counters: float = 0  # Adam's 0-dim step tensors

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


# --8<-- [start:paper]
def paper_ledger(numel: int, world_size: int, stage: int,
                 precision: str = "mixed_adam") -> Ledger:
    """The paper's accounting for Ψ = ``numel`` parameters: stage 0 is DDP, stage s ≥ 1 splits
    the first s of (optimizer state, gradients, parameters) into N equal parts."""
    per_param, grad, state = PAPER_BYTES[precision]
    n = world_size
    return Ledger(params=numel * per_param / (n if stage >= 3 else 1),
                  grads=numel * grad / (n if stage >= 2 else 1),
                  optimizer_state=numel * state / (n if stage >= 1 else 1))
# --8<-- [end:paper]


def state_bytes(numel: int, tensors: int, optimizer: str) -> Ledger:
    """The optimizer state of ``tensors`` parameter tensors holding ``numel`` elements (fp32)."""
    per_element, has_step = STATE[optimizer]
    return Ledger(optimizer_state=numel * per_element * FP32,
                  counters=tensors * FP32 if has_step else 0)


def ddp_ledger(params: list[torch.Tensor], optimizer: str = "adam") -> Ledger:
    numel = sum(p.numel() for p in params)
    state = state_bytes(numel, len(params), optimizer)
    return Ledger(numel * FP32, numel * FP32, state.optimizer_state, state.counters)


def zero1_ledger(params: list[torch.Tensor], world_size: int, rank: int,
                 optimizer: str = "adam") -> Ledger:
    """Everything full but the state, which is that of the whole parameters ``rank`` owns."""
    owned = partition_parameters(params, world_size)[rank]
    full = ddp_ledger(params, optimizer)
    state = state_bytes(sum(p.numel() for p in owned), len(owned), optimizer)
    return Ledger(full.params, full.grads, state.optimizer_state, state.counters)


def zero2_ledger(bucket_numels: list[int], world_size: int, optimizer: str = "adam") -> Ledger:
    """Buckets padded to a multiple of N: the full padded buffers as parameters, one shard of
    each as gradient and as the optimizer's parameter (one step counter per shard)."""
    padded = [math.ceil(b / world_size) * world_size for b in bucket_numels]
    shard = sum(p // world_size for p in padded)
    state = state_bytes(shard, len(padded), optimizer)
    return Ledger(sum(padded) * FP32, shard * FP32, state.optimizer_state, state.counters)


def dim0_shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """FSDP2's cut of a parameter with ``rows`` rows: (rows this rank really has, rows its
    padded shard has).  Chunks of ⌈rows/N⌉ as ``torch.chunk`` makes them; the last ranks can
    have fewer, or none."""
    per_rank = math.ceil(rows / world_size)
    return max(0, min(per_rank, rows - rank * per_rank)), per_rank


# --8<-- [start:measure]
def measure(params: Iterable[torch.Tensor], optimizer: Optimizer | None = None) -> Ledger:
    """Bytes of every storage behind ``params``, their ``.grad`` and ``optimizer``'s state,
    each storage counted once, under the first kind it appears in."""
    seen: set[tuple[torch.device, int]] = set()

    def new_bytes(tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            t = local(t)
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        return total

    params = list(params)
    state = [] if optimizer is None else [
        v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return Ledger(params=new_bytes(params),
                  grads=new_bytes(p.grad for p in params if p.grad is not None),
                  optimizer_state=new_bytes(v for v in state if v.dim() > 0),
                  counters=new_bytes(v for v in state if v.dim() == 0))
# --8<-- [end:measure]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters are DTensors); any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def profiler_peak_bytes(work: Callable[[], object], device: str = "cpu") -> int:
    """The most bytes ``work()`` had allocated at any moment on ``device``'s type (above what
    was allocated before it started), from ``torch.profiler``'s allocation events."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        work()
    wanted = device.upper()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type().name == wanted)
    running = peak = 0
    for _, nbytes in events:  # allocations are positive, frees negative
        running += nbytes
        peak = max(peak, running)
    return peak


def zero3_ledger(shapes: list[tuple[int, ...]], world_size: int, rank: int,
                 optimizer: str = "adam") -> Ledger:
    """FSDP2 after a step: each parameter's padded shard (⌈d₀/N⌉ rows) as parameter and as
    gradient; the optimizer's state is as large as the rows this rank really has."""
    padded = real = 0
    for shape in shapes:
        rows, padded_rows = dim0_shard_rows(shape[0], world_size, rank)
        row_numel = math.prod(shape[1:])
        padded, real = padded + padded_rows * row_numel, real + rows * row_numel
    state = state_bytes(real, len(shapes), optimizer)
    return Ledger(padded * FP32, padded * FP32, state.optimizer_state, state.counters)
