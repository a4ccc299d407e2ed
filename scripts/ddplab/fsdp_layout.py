"""Where every element of a sharded parameter and of its gradient lives: pure functions, no ranks.

FSDP2 (``fully_shard``) shards each parameter on dim 0 with ``torch.chunk`` and pads every shard
to the size of the first one (``_fsdp_param.py``, ``_init_sharded_param``; the padded dim 0 is
``_fsdp_common._get_dim0_padded_size``: ``ceil(d / N) * N``).  A unit's gradients are then laid
out *shard-major* for one reduce-scatter (``_fsdp_collectives.foreach_reduce_scatter_copy_in``,
``torch.ops.fsdp.chunk_cat``): row r of the message holds rank r's chunk of every parameter, so
the reduce-scatter hands rank r exactly its shards.  The functions here build that layout by hand
(and the flat parameter-major one, for comparison), so that a grader can check a layout against
``torch._chunk_cat`` without starting a rank.
"""

from __future__ import annotations

import math

import torch


def padded_rows(rows: int, world_size: int) -> int:
    """Rows of every rank's padded shard: the first chunk's size, ``ceil(rows / N)``."""
    return math.ceil(rows / world_size)


def shard_rows(rows: int, rank: int, world_size: int) -> range:
    """The dim-0 rows rank ``rank`` owns, as ``torch.chunk`` splits them (last ranks may get
    fewer rows, or none: 4 rows over 3 ranks are 2, 2, 0 — ``_chunk_with_empty``)."""
    step = padded_rows(rows, world_size)
    return range(min(rank * step, rows), min((rank + 1) * step, rows))


def shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``tensor`` (unpadded): what its optimizer steps.

    A copy, not a view: a slice of rows is already contiguous, so ``.contiguous()`` would
    return a view that keeps the whole unsharded parameter alive, and sharding would save no
    memory (the memory ledger catches exactly that)."""
    rows = shard_rows(tensor.shape[0], rank, world_size)
    return tensor[rows.start:rows.stop].clone()


def padded_shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The shard followed by zero rows up to ``padded_rows``, flattened: one all-gather input."""
    return pad(shard(tensor, rank, world_size), tensor.shape[0], world_size)


def pad(piece: torch.Tensor, rows: int, world_size: int) -> torch.Tensor:
    """A shard of a ``rows``-row tensor, zero rows appended up to ``padded_rows``, flattened
    (FSDP2 keeps its shards padded this way: ``_init_sharded_param``)."""
    out = piece.new_zeros((padded_rows(rows, world_size), *piece.shape[1:]))
    out[:piece.shape[0]] = piece
    return out.reshape(-1)


def shard_major(tensors: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """FSDP2's reduce-scatter input: ``(N, S)``, row r = rank r's padded chunk of each tensor in
    turn (equal to ``torch._chunk_cat(tensors, dim=0, num_chunks=N)``).  Written straight into
    one message, as ``foreach_reduce_scatter_copy_in`` does: no per-rank copy on the way."""
    sizes = [padded_rows(t.shape[0], world_size) * math.prod(t.shape[1:]) for t in tensors]
    message = tensors[0].new_empty(world_size, sum(sizes))
    for column, tensor in zip(message.split(sizes, dim=1), tensors, strict=True):
        flat, step = tensor.reshape(-1), column.shape[1]
        for rank in range(world_size):  # rank r's rows, then zeros up to the padded size
            piece = flat[rank * step:(rank + 1) * step]  # shorter, or empty, at the end
            column[rank, :piece.numel()].copy_(piece)
            column[rank, piece.numel():].zero_()
    return message


def parameter_major(tensors: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """The flat layout a DDP bucket uses: each whole (padded) tensor in turn, ``(N * S,)``."""
    return torch.cat([torch.cat([padded_shard(t, r, world_size) for r in range(world_size)])
                      for t in tensors])


def split_shards(row: torch.Tensor, shapes: list[torch.Size], rank: int,
                 world_size: int) -> list[torch.Tensor]:
    """Rank ``rank``'s row of a shard-major message cut back into its (unpadded) shards."""
    out, offset = [], 0
    for shape in shapes:
        inner = math.prod(shape[1:])
        owned = len(shard_rows(shape[0], rank, world_size))
        out.append(row[offset:offset + owned * inner].view(owned, *shape[1:]))
        offset += padded_rows(shape[0], world_size) * inner
    return out


def unshard(gathered: torch.Tensor, shapes: list[torch.Size],
            world_size: int) -> list[torch.Tensor]:
    """Full tensors from an all-gather of every rank's padded shards (``(N * S,)``, shard-major):
    each rank's chunk of a tensor in rank order, padding dropped (``init_unsharded_param`` views
    the gathered rows at the parameter's size, so the padding rows at the end are left out)."""
    full = [gathered.new_empty(shape) for shape in shapes]
    unshard_into(gathered, full, world_size)
    return full


def unshard_into(gathered: torch.Tensor, full: list[torch.Tensor], world_size: int) -> None:
    """``unshard`` written into ``full`` in place, a rank's chunk at a time: no temporary.

    Rank r's rows start at element ``r * step`` of the flat tensor (only the last chunks are
    short: ``shard_rows``), so each chunk is one copy."""
    per_rank = gathered.view(world_size, -1)
    shapes = [f.shape for f in full]
    for index, out in enumerate(full):
        chunks = split_padded(per_rank, shapes, index, world_size)
        flat, step = out.view(-1), chunks.shape[1]
        for rank in range(world_size):
            piece = flat[rank * step:(rank + 1) * step]
            piece.copy_(chunks[rank, :piece.numel()])


def pad_into(shards: list[torch.Tensor], shapes: list[torch.Size], world_size: int,
             row: torch.Tensor) -> None:
    """Each shard into its padded slot of ``row`` (this rank's all-gather input), zeros after
    it: ``all_gather_copy_in``'s copy, made straight into the all-gather's output."""
    offset = 0
    for piece, shape in zip(shards, shapes, strict=True):
        size = padded_rows(shape[0], world_size) * math.prod(shape[1:])
        row[offset:offset + piece.numel()].copy_(piece.reshape(-1))
        row[offset + piece.numel():offset + size].zero_()
        offset += size


def split_padded(per_rank: torch.Tensor, shapes: list[torch.Size], index: int,
                 world_size: int) -> torch.Tensor:
    """Every rank's padded chunk of tensor ``index``: ``(N, padded_rows * inner)``."""
    sizes = [padded_rows(s[0], world_size) * math.prod(s[1:]) for s in shapes]
    start = sum(sizes[:index])
    return per_rank[:, start:start + sizes[index]]


def offsets(shapes: list[torch.Size], index: int, element: int, world_size: int) -> dict:
    """Where element ``element`` (flat index into tensor ``index``) sits in each layout's
    message: the offset an all-reduce of that message sees it at."""
    inner = math.prod(shapes[index][1:])
    rows = padded_rows(shapes[index][0], world_size)
    sizes = [padded_rows(s[0], world_size) * math.prod(s[1:]) for s in shapes]
    rank, within = divmod(element, rows * inner)
    return {"owner": rank,
            "shard_major": rank * sum(sizes) + sum(sizes[:index]) + within,
            "parameter_major": world_size * sum(sizes[:index]) + element}
