"""PowerSGD by hand: send a rank-r approximation of each gradient matrix instead of the matrix.

Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization" (NeurIPS 2019, arXiv:1905.13727), as torch implements it in
torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py (``powerSGD_hook``).  An n × m
gradient M becomes P (n × r) and Q (m × r): r(n + m) numbers on the wire instead of n·m.

    P = M Q          all-reduce P, orthogonalise its columns
    Q = Mᵀ P         all-reduce Q, divide by the world size
    M ≈ P Qᵀ         the same on every rank, because P and Q are

Two things make it train as well as plain averaging: **error feedback** (what the
approximation left out this step is added to next step's gradient, so nothing is lost for good)
and a **warm start** (Q is kept from the last step: one power-iteration step per training step
refines it).  Vectors (biases, LayerNorm) and matrices too small to gain are averaged as they
are.  The first ``start_iter`` steps use plain averaging, as torch's ``start_powerSGD_iter``.

With a GradScaler one overflow would end training: error feedback would keep the inf (as NaN)
in the residual and the warm start in Q, so every later step would be non-finite and skipped.
torch 2.13's ``powerSGD_hook`` stores both unconditionally; this one forgets them instead, and
on a step that overflowed in any bucket it drops every bucket's residual: the scaler skips the
whole step and halves its scale, so a residual kept from it would be twice too large.

Written to be read, so it waits for each all-reduce in turn (torch chains futures instead);
it draws its random start and orders its matrices as torch does, so that the two agree.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from .comm_hooks import completed


@dataclass
class PowerSGDState:
    rank: int = 2                       # r: columns of P and Q
    start_iter: int = 10                # plain averaging before (torch: start_powerSGD_iter)
    seed: int = 0
    min_compression_rate: float = 2.0   # compress only if n·m > rate · r(n + m) (torch's rule)
    group: dist.ProcessGroup | None = None
    iter: int = 0
    overflowed: bool = False            # a bucket of this backward pass was non-finite
    error: dict[int, torch.Tensor] = field(default_factory=dict)    # per bucket: what was lost
    q_memory: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # per bucket: warm Qs

    def __post_init__(self):
        self.rng = np.random.RandomState(self.seed)  # torch draws its seeds the same way


def orthogonalize(matrix: torch.Tensor) -> None:
    """Gram-Schmidt, in place: the columns become orthonormal (torch's rank <= 2 path)."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i:i + 1]
        col /= torch.norm(col, dim=0, keepdim=True)
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1:]
            rest -= torch.sum(col * rest, dim=0, keepdim=True) * col


def split(gradients: list[torch.Tensor], state: PowerSGDState):
    """The matrices worth compressing (as n × m views), grouped by shape as torch groups them,
    and the rest (vectors, small matrices), sent as they are."""
    by_shape: dict[torch.Size, list[torch.Tensor]] = defaultdict(list)
    plain = []
    for grad in gradients:
        if grad.dim() < 2:              # scalars and vectors: nothing to gain (torch's rule too)
            plain.append(grad)
            continue
        matrix = grad.view(grad.shape[0], -1)
        n, m = matrix.shape
        r = min(n, m, state.rank)
        if n * m > state.min_compression_rate * r * (n + m):
            by_shape[matrix.shape].append(matrix)
        else:
            plain.append(grad)
    return [m for group in by_shape.values() for m in group], plain


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, computed as a batch of one, as torch's hook does (``torch.bmm``): for small
    matrices the CPU takes another kernel for ``mm`` than for ``bmm``, which rounds differently."""
    return torch.bmm(a.unsqueeze(0), b.unsqueeze(0)).squeeze(0)


def average(tensor: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(tensor, group=group)
    return tensor.div_(dist.get_world_size(group))


def start_qs(matrices: list[torch.Tensor], state: PowerSGDState, key: int) -> list[torch.Tensor]:
    """Last step's Qs (warm start), or random ones drawn from the same seed on every rank."""
    if key in state.q_memory:
        return state.q_memory[key]
    qs = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(state.rng.randint(1_000_000_000))
        for matrix in matrices:
            qs.append(torch.randn(matrix.shape[1], min(*matrix.shape, state.rank),
                                  dtype=matrix.dtype).to(matrix.device))
    state.q_memory[key] = qs
    return qs


# --8<-- [start:powersgd]
def powersgd_hook(state: PowerSGDState, bucket):  # returns a Future
    buffer, key, group = bucket.buffer(), bucket.index(), state.group
    if state.iter < state.start_iter:             # plain averaging for the first steps
        state.iter += bucket.is_last()
        return completed(average(buffer, group))
    buffer += state.error.get(key, 0)             # error feedback: add what was lost last time
    before = buffer.clone()
    matrices, plain = split(bucket.gradients(), state)
    average_whole(plain, group)                   # vectors and small matrices: sent whole
    qs = start_qs(matrices, state, key)
    for q in qs:
        orthogonalize(q)
    ps = [matmul(m, q) for m, q in zip(matrices, qs, strict=True)]  # P = M Q
    flat_p = flatten(ps, buffer)
    dist.all_reduce(flat_p, group=group)                           # sum of the ranks' Ps
    ps = [p.view(m.shape[0], -1) for p, m in zip(unflatten(flat_p, ps), matrices, strict=True)]
    for p in ps:
        orthogonalize(p)
    for m, p, q in zip(matrices, ps, qs, strict=True):
        q.copy_(matmul(m.t(), p))                                  # Q = Mᵀ P
    flat_q = average(flatten(qs, buffer), group)
    for m, p, q, avg_q in zip(matrices, ps, qs, unflatten(flat_q, qs), strict=True):
        q.copy_(avg_q.view_as(q))                                  # kept: the warm start
        m.copy_(matmul(p, q.t()))                                  # M ≈ P Qᵀ, into the bucket
    if torch.isfinite(buffer).all():
        state.error[key] = before - buffer                         # what the rank r missed
    else:                   # an overflow (seen by every rank: P and Q are all-reduced)
        forget(state, key)  # the scaler skips this step; keep no inf/NaN for the next
    end_of_step(state, bucket)  # after the last bucket: one overflow anywhere, no residuals
    return completed(buffer)
# --8<-- [end:powersgd]


# --8<-- [start:forget]
def forget(state: PowerSGDState, key: int) -> None:
    """After a non-finite gradient, drop the residual and the warm-start Q: both would hold
    inf/NaN from now on, and every later step would be skipped."""
    state.error.pop(key, None)
    state.q_memory.pop(key, None)
    state.overflowed = True


def end_of_step(state: PowerSGDState, bucket) -> None:
    """After the last bucket: if any bucket overflowed, the scaler skips the whole step and
    halves its scale, so the other buckets' residuals (in the old scale's units, for a step
    that never happens) go too.  Their Qs stay: a warm start has no scale."""
    if not bucket.is_last():
        return
    if state.overflowed:
        state.error.clear()
    state.overflowed = False
# --8<-- [end:forget]


def flatten(tensors: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """One flat tensor of ``tensors``; an empty one (of ``like``'s dtype and device) when a
    bucket has no matrix worth compressing, so every rank still makes the same calls."""
    if not tensors:
        return like.new_empty(0)
    return torch.cat([t.reshape(-1) for t in tensors])


def average_whole(tensors: list[torch.Tensor], group) -> None:
    """Average ``tensors`` in place, as one flat all-reduce (none if there are none)."""
    if not tensors:
        return
    flat = average(torch.cat([t.reshape(-1) for t in tensors]), group)
    for t, avg in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(avg.view_as(t))


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(flat.split([t.numel() for t in like]))
