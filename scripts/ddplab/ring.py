"""All-reduce built from point-to-point messages: a naive one, then the ring.

``naive_all_reduce``: every rank sends its tensor to rank 0, rank 0 adds them up and sends the
sum back.  Rank 0 receives (N-1)·S bytes, then sends (N-1)·S more: its link is the bottleneck,
and it gets worse with every rank you add.

``ring_all_reduce``: the ranks stand in a ring and each one only talks to its two neighbours.
The tensor is cut into N chunks, and the sum is built in two phases of N-1 steps each:

1. reduce-scatter: at step s, rank r sends chunk (r-s) mod N to the right and adds the chunk
   (r-s-1) mod N that arrives from the left into its own copy.  After N-1 steps, rank r holds
   the finished sum of chunk (r+1) mod N.
2. all-gather: the finished chunks go round the ring once more, copied instead of added.

``textbook_ring_all_reduce`` writes the two phases as two loops of send/recv, as the ring is
drawn.  The chunk a rank receives at one step is the chunk it sends at the next, so the fast
version, ``ring_all_reduce``, is a relay: send your own chunk, then 2(N-1) times receive a chunk,
add it (or keep it), and pass it on, with receives posted ahead and large chunks in segments.

Every rank sends 2(N-1)/N·S bytes in total, whatever N is: the bandwidth-optimal all-reduce
(Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
JPDC 2009).  gloo's all-reduce runs this same ring, and so does NCCL's ring algorithm.
"""

from __future__ import annotations

import threading
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Large chunks travel as segments of at most this many bytes, so that adding one segment
# overlaps with receiving the next.  gloo's C++ ring uses at most 1 MiB; 2 MiB was picked from
# interleaved A/B runs at 64 MiB, and chapter 03's sweep shows what the other sizes cost.
SEGMENT_BYTES = 2 << 20
IN_FLIGHT = 2  # receives posted ahead: one being filled while the previous one is added


class SizeMismatchError(ValueError):
    """The ranks passed tensors of different sizes or dtypes to the same all-reduce."""


# --8<-- [start:check_same_tensor]
def check_same_tensor(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if the ranks' tensors differ in size or dtype.

    Without this check, a rank with a longer tensor waits for bytes its neighbour never sends:
    a hang until the timeout.  The check is one extra all-reduce of four integers: a whole
    small-message latency, which is why ``ring_all_reduce(check=False)`` can skip it.
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
    if not tensor.is_contiguous():
        return tensor.reshape(-1).clone()
    return tensor if tensor.dim() == 1 else tensor.view(-1)


def _peer(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """send/recv take global ranks; inside a sub-group, translate the group rank."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


# --8<-- [start:naive]
def naive_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                     check: bool = True) -> torch.Tensor:
    """In-place SUM: everyone sends to rank 0, rank 0 adds, rank 0 sends the sum back."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if check:
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
        for work in [dist.isend(flat, dst, group) for dst in others]:  # only now: the sum
            work.wait()
    else:
        dist.send(flat, _peer(group, 0), group)
        dist.recv(flat, _peer(group, 0), group)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor
# --8<-- [end:naive]


# --8<-- [start:textbook]
def textbook_ring_all_reduce(tensor: torch.Tensor,
                             group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place SUM, the ring as drawn: N-1 reduce-scatter steps, then N-1 all-gather steps."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = _flat(tensor)
    chunks = flat.tensor_split(world)  # N chunks; sizes differ by at most one element
    right, left = _peer(group, (rank + 1) % world), _peer(group, (rank - 1) % world)

    def send_and_receive(outgoing: torch.Tensor, incoming_like: torch.Tensor) -> torch.Tensor:
        incoming = torch.empty_like(incoming_like)
        sending = dist.isend(outgoing, right, group)  # not send: every rank sends at once,
        dist.recv(incoming, left, group)              # and a blocking send would wait forever
        sending.wait()
        return incoming

    for s in range(world - 1):  # reduce-scatter: add what arrives into our own copy
        mine, arriving = (rank - s) % world, (rank - s - 1) % world
        chunks[arriving].add_(send_and_receive(chunks[mine], chunks[arriving]))
    for s in range(world - 1):  # all-gather: pass the finished sums on, copied
        mine, arriving = (rank + 1 - s) % world, (rank - s) % world
        chunks[arriving].copy_(send_and_receive(chunks[mine], chunks[arriving]))
    if flat.data_ptr() != tensor.data_ptr():  # we worked on a contiguous copy
        tensor.copy_(flat.view_as(tensor))
    return tensor
# --8<-- [end:textbook]


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
                    check: bool = True, segment_bytes: int = SEGMENT_BYTES,
                    trace: Callable[[RingStep], None] | None = None) -> torch.Tensor:
    """In-place SUM over the ranks of ``group``, from send/recv: reduce-scatter, all-gather."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if check:
        check_same_tensor(tensor, group)  # a clear error instead of a hang (see below)
    if world == 1 or tensor.numel() == 0:
        return tensor
    flat = _flat(tensor)
    chunks = flat.tensor_split(world)  # N chunks; sizes differ by at most one element
    # Step s: chunk (r-s-1) arrives from the left.  The first N-1 steps add it in (the
    # reduce-scatter), the last N-1 keep it (the all-gather); at step s+1 it goes on, right.
    plan = [((rank - s - 1) % world, s < world - 1) for s in range(2 * (world - 1))]
    link = _link(group, rank, world, [(chunks[c], add) for c, add in plan], segment_bytes,
                 ahead=1 if trace else IN_FLIGHT)  # a trace reads chunks: nothing lands early
    link.send(chunks[rank])  # step 0 sends this rank's own chunk
    for step, (chunk, add) in enumerate(plan):
        link.relay(pass_on=step < len(plan) - 1)  # wait for it, add it (or keep it), pass it on
        if trace:
            phase, i = ("reduce-scatter", step) if add else ("all-gather", step - world + 1)
            trace(RingStep(phase, i, rank, (rank - step) % world, chunk, list(chunks)))
    link.finish()  # our sends have left: the caller may change the tensor again
    if flat.data_ptr() != tensor.data_ptr():  # we worked on a contiguous copy
        tensor.copy_(flat.view_as(tensor))
    return tensor
# --8<-- [end:ring]


def _link(group, rank: int, world: int, incoming: list, segment_bytes: int, ahead: int):
    """The exchange that suits the backend: gloo's messages, or nccl's grouped launches."""
    if dist.get_backend(group) == "gloo":
        elems = max(1, segment_bytes // incoming[0][0].element_size())
        return _RingLink(group, rank, world, incoming, elems, ahead)
    return _GroupedLink(group, rank, world, incoming)


class _RingLink:
    """This rank's place in the ring: receives posted ahead, pieces passed on as they arrive."""

    def __init__(self, group, rank: int, world: int, incoming: list, segment: int, ahead: int):
        self.group, self.segment, self.ahead = group, segment, ahead
        self.right = _peer(group, (rank + 1) % world)
        self.left = _peer(group, (rank - 1) % world)
        self.steps = [(self.pieces(chunk), add) for chunk, add in incoming]  # step by step
        # Every message this rank will receive, in order: (piece of a chunk, add it?).
        self.todo = deque((piece, add) for pieces, add in self.steps for piece in pieces)
        self.posted: deque = deque()  # (work, landing buffer, piece, add), oldest first
        self.scratch = _KEPT.take()  # receive buffers for the pieces that are added
        self.sends: list = []
        self.largest_piece = max(chunk.numel() for chunk, _ in incoming)
        self.added_receives = 0
        self._post_ahead()  # before any send: a send waits for its receive to be posted

    def pieces(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """The messages a chunk travels as.  An empty chunk (a tensor smaller than N) sends
        nothing, and its receiver expects nothing."""
        if chunk.numel() <= self.segment:  # the common case: one message, no split to pay for
            return [chunk] if chunk.numel() else []
        return list(chunk.split(self.segment))

    def send(self, chunk: torch.Tensor) -> None:
        self.sends += [dist.isend(piece, self.right, self.group) for piece in self.pieces(chunk)]

    # --8<-- [start:relay]
    def relay(self, pass_on: bool) -> None:
        """One step: each piece of the arriving chunk is waited for, added, and passed on."""
        pieces, _ = self.steps.pop(0)
        for _ in pieces:
            self._post_ahead()
            work, landed, piece, add = self.posted.popleft()
            work.wait()
            if add:
                piece.add_(landed)
            if pass_on:
                self.sends.append(dist.isend(piece, self.right, self.group))

    def _post_ahead(self) -> None:
        """Keep ``ahead`` receives posted, so a piece never waits for us to ask for it."""
        while self.todo and len(self.posted) < self.ahead:
            piece, add = self.todo.popleft()
            landing = self._scratch(piece) if add else piece  # kept pieces land in place
            self.posted.append((dist.irecv(landing, self.left, self.group), landing, piece, add))
    # --8<-- [end:relay]

    def finish(self) -> None:
        for work in self.sends:
            work.wait()
        _KEPT.put_back(self.scratch)  # every receive has landed: the next call may reuse them

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """Receive buffer number k % ahead for the k-th added piece: by the time it is reused,
        the piece that last landed in it has been added (``relay`` tops up before it waits)."""
        slot = (self.added_receives % self.ahead, like.dtype, like.device)
        self.added_receives += 1
        buffer = self.scratch.get(slot)
        if buffer is None or buffer.numel() < like.numel():
            size = min(self.segment, self.largest_piece)
            buffer = self.scratch[slot] = torch.empty(size, dtype=like.dtype, device=like.device)
        return buffer if buffer.numel() == like.numel() else buffer[: like.numel()]


class _KeptBuffers(threading.local):
    """The receive buffers of the last call, kept for the next one (one set per thread).

    A fresh buffer for every call made a 1 MiB call tens of µs slower on the book's 2-core
    machine (an interleaved A/B run); NCCL, too, sets up its buffers once and reuses them.
    A call takes the set and gives it back only when every receive has landed, so a call made
    while another is running, or after one that failed half-way, never gets a buffer that a
    receive may still be writing into.
    At most ``IN_FLIGHT`` buffers per dtype and device stay allocated, each at most a segment
    (or a chunk, when the chunks are smaller).
    """

    def __init__(self) -> None:
        self.free: dict = {}

    def take(self) -> dict:
        held, self.free = self.free, {}
        return held

    def put_back(self, held: dict) -> None:
        self.free = held


_KEPT = _KeptBuffers()


class _GroupedLink:
    """The relay for nccl: each step's send and receive launched together, as one group.

    NCCL runs point-to-point ops as kernels queued on a stream.  Queue a send before the
    receive on two ranks that exchange with each other, and each send waits for a receive
    queued behind the other rank's send: a deadlock (NVIDIA/nccl#479).  ``batch_isend_irecv``
    launches the list as one NCCL group.  Whole chunks, no segments: this path is correct but
    not tuned, and this book has not measured it.
    """

    def __init__(self, group, rank: int, world: int, incoming: list):
        self.group, self.incoming = group, deque(incoming)
        self.right = _peer(group, (rank + 1) % world)
        self.left = _peer(group, (rank - 1) % world)
        self.outgoing: torch.Tensor | None = None

    def send(self, chunk: torch.Tensor) -> None:
        self.outgoing = chunk  # goes out with the next step's receive

    # --8<-- [start:grouped]
    def relay(self, pass_on: bool) -> None:
        """One step: this step's send and receive, launched together as one NCCL group."""
        incoming, add = self.incoming.popleft()
        landing = torch.empty_like(incoming) if add else incoming
        ops = [dist.P2POp(dist.isend, self.outgoing, self.right, self.group)
               ] if self.outgoing is not None and self.outgoing.numel() else []
        if incoming.numel():
            ops.append(dist.P2POp(dist.irecv, landing, self.left, self.group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        if add:
            incoming.add_(landing)
        self.outgoing = incoming if pass_on else None
    # --8<-- [end:grouped]

    def finish(self) -> None:
        pass  # every step waited for its own send
