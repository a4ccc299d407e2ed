"""All-reduce built from point-to-point messages: a naive one, then the ring.

``naive_all_reduce``: every rank sends its tensor to rank 0, rank 0 adds them up and sends the
sum back.  Rank 0 sends and receives (N-1)·S bytes: its link is the bottleneck, and it gets
worse with every rank you add.

``ring_all_reduce``: the ranks stand in a ring and each one only talks to its two neighbours.
The tensor is cut into N chunks, and the sum is built in two phases of N-1 steps each:

1. reduce-scatter: at step s, rank r sends chunk (r-s) mod N to the right and adds the chunk
   (r-s-1) mod N that arrives from the left into its own copy.  After N-1 steps, rank r holds
   the finished sum of chunk (r+1) mod N.
2. all-gather: the finished chunks go round the ring once more, copied instead of added.

Every rank sends 2(N-1)/N·S bytes in total, whatever N is: the bandwidth-optimal all-reduce
(Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
JPDC 2009).  gloo's all-reduce runs this same ring, and so does NCCL's ring algorithm.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Large chunks travel as segments of at most this many bytes, so that adding one segment
# overlaps with receiving the next.  gloo's C++ ring uses 1 MiB; each message sent from
# Python costs more (chapter 03 measures it), so we send fewer, larger ones.
SEGMENT_BYTES = 4 << 20
IN_FLIGHT = 2  # receive buffers per exchange: one being filled while the other is added


class SizeMismatchError(ValueError):
    """The ranks passed tensors of different sizes or dtypes to the same all-reduce."""


# --8<-- [start:check_same_tensor]
def check_same_tensor(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if the ranks' tensors differ in size or dtype.

    Without this check, a rank with a longer tensor waits for bytes its neighbour never sends:
    a hang until the timeout.  The check is one extra all-reduce of four integers, so it adds
    one small-message latency (alpha) to every call; chapter 03 measures it.
    """
    dtype_id = zlib.crc32(str(tensor.dtype).encode())  # the same number in every process
    mine = [tensor.numel(), dtype_id]
    extremes = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=tensor.device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)  # max and -min of each
    largest, smallest = extremes[:2].tolist(), [-v for v in extremes[2:].tolist()]
    if largest != smallest:
        what = "dtypes" if largest[0] == smallest[0] else "sizes"
        raise SizeMismatchError(
            f"all-reduce: the ranks passed tensors of different {what} (numel from "
            f"{smallest[0]} to {largest[0]}; this rank has {tensor.numel()} elements of "
            f"{tensor.dtype}); every rank must pass a tensor of the same size and dtype")
# --8<-- [end:check_same_tensor]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the tensor's memory, or a contiguous copy when it has no such view."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()


def _peer(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """send/recv take global ranks; inside a sub-group, translate the group rank."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


# --8<-- [start:naive]
def naive_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None):
    """In-place SUM: everyone sends to rank 0, rank 0 adds, rank 0 sends the sum back."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    check_same_tensor(tensor, group)
    if world == 1 or tensor.numel() == 0:
        return tensor
    flat = _flat(tensor)
    others = [_peer(group, r) for r in range(1, world)]
    if rank == 0:
        inbox = [torch.empty_like(flat) for _ in others]  # (N-1)·S bytes of buffers
        receives = [dist.irecv(buf, src, group) for src, buf in zip(others, inbox, strict=True)]
        for work, buf in zip(receives, inbox, strict=True):
            work.wait()
            flat.add_(buf)
        for work in [dist.isend(flat, dst, group) for dst in others]:
            work.wait()
    else:
        dist.send(flat, _peer(group, 0), group)
        dist.recv(flat, _peer(group, 0), group)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor
# --8<-- [end:naive]


@dataclass(frozen=True)
class RingStep:
    """What one rank did in one step of the ring, passed to ``trace`` after the step."""

    phase: str  # "reduce-scatter" or "all-gather"
    step: int  # 0 … N-2 within the phase
    rank: int  # this rank, in the group
    sent_chunk: int  # index of the chunk sent to the right neighbour
    received_chunk: int  # index of the chunk received from the left neighbour
    chunks: list[torch.Tensor]  # views of this rank's chunks after the step (do not keep)


# --8<-- [start:ring]
def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                    segment_bytes: int = SEGMENT_BYTES,
                    trace: Callable[[RingStep], None] | None = None) -> torch.Tensor:
    """In-place SUM over the ranks of ``group``, from send/recv: reduce-scatter, all-gather."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    check_same_tensor(tensor, group)  # a clear error instead of a hang
    if world == 1 or tensor.numel() == 0:
        return tensor
    flat = _flat(tensor)
    chunks = flat.tensor_split(world)  # N chunks; sizes differ by at most one element
    segment = min(segment_bytes // flat.element_size(), chunks[0].numel())  # chunk 0: largest
    link = _RingLink(group, rank, world, segment)

    for step in range(world - 1):  # reduce-scatter: add what arrives
        send, recv = (rank - step) % world, (rank - step - 1) % world
        link.exchange(chunks[send], chunks[recv], add=True)
        if trace:
            trace(RingStep("reduce-scatter", step, rank, send, recv, list(chunks)))

    for step in range(world - 1):  # all-gather: rank r owns chunk r+1; pass the sums on
        send, recv = (rank + 1 - step) % world, (rank - step) % world
        link.exchange(chunks[send], chunks[recv], add=False)
        if trace:
            trace(RingStep("all-gather", step, rank, send, recv, list(chunks)))

    if flat.data_ptr() != tensor.data_ptr():  # we worked on a contiguous copy
        tensor.copy_(flat.view_as(tensor))
    return tensor
# --8<-- [end:ring]


# --8<-- [start:exchange]
class _RingLink:
    """This rank's two neighbours, and one step of the ring: send a chunk, receive another."""

    def __init__(self, group, rank: int, world: int, segment_elems: int):
        self.group = group
        self.right = _peer(group, (rank + 1) % world)
        self.left = _peer(group, (rank - 1) % world)
        self.segment = max(1, segment_elems)
        self.scratch: list[torch.Tensor] = []  # receive buffers for the reduce-scatter
        self.grouped = dist.get_backend(group) != "gloo"  # nccl: see _exchange_grouped

    def exchange(self, outgoing: torch.Tensor, incoming: torch.Tensor, add: bool) -> None:
        """Send ``outgoing`` right while ``incoming`` arrives from the left, segment by segment.

        add=False (all-gather): receive straight into ``incoming``, no copy.
        add=True (reduce-scatter): receive into a scratch buffer, then ``incoming += buffer``;
        with IN_FLIGHT buffers, the next segments arrive while this one is being added.
        """
        if self.grouped:
            return self._exchange_grouped(outgoing, incoming, add)
        sends = [dist.isend(seg, self.right, self.group) for seg in self._segments(outgoing)]
        if not add:
            receives = [dist.irecv(seg, self.left, self.group) for seg in self._segments(incoming)]
            for work in receives:
                work.wait()
        else:
            pending: deque = deque()
            for i, target in enumerate(self._segments(incoming)):
                if len(pending) == IN_FLIGHT:
                    self._add_when_arrived(*pending.popleft())
                buffer = self._scratch(i % IN_FLIGHT, target)
                pending.append((dist.irecv(buffer, self.left, self.group), buffer, target))
            while pending:
                self._add_when_arrived(*pending.popleft())
        for work in sends:
            work.wait()

    def _segments(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        # An empty chunk (tensor smaller than N) sends nothing; its receiver expects nothing.
        return list(chunk.split(self.segment)) if chunk.numel() else []

    @staticmethod
    def _add_when_arrived(work, buffer: torch.Tensor, target: torch.Tensor) -> None:
        work.wait()
        target.add_(buffer)

    def _scratch(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        """Receive buffer number ``slot``, allocated once per call and reused for every step."""
        if len(self.scratch) <= slot:
            self.scratch.append(torch.empty(self.segment, dtype=like.dtype, device=like.device))
        return self.scratch[slot][: like.numel()]
# --8<-- [end:exchange]

    # --8<-- [start:grouped]
    def _exchange_grouped(self, outgoing: torch.Tensor, incoming: torch.Tensor,
                          add: bool) -> None:
        """The exchange for nccl: the send and the receive launched together, as one group.

        NCCL runs point-to-point ops as kernels queued on a stream.  Queue a send before the
        receive on two ranks that exchange with each other, and each send waits for a
        receive queued behind the other rank's send: a deadlock (NVIDIA/nccl#479).
        ``batch_isend_irecv`` launches the list as one NCCL group.  Whole chunks, no
        segments: this path is correct but not tuned, and this book has not measured it.
        """
        landing = torch.empty_like(incoming) if add else incoming
        ops = [dist.P2POp(dist.isend, outgoing, self.right, self.group)] if outgoing.numel() else []
        if incoming.numel():
            ops.append(dist.P2POp(dist.irecv, landing, self.left, self.group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        if add:
            incoming.add_(landing)
    # --8<-- [end:grouped]
