"""Native DDP's bucket packing rule, once, for every caller in the book.

Native DDP packs gradients with one function, ``compute_bucket_assignment_by_size`` in
torch/csrc/distributed/c10d/reducer.cpp, called at two moments:

* **At construction** (``_ddp_init_helper`` in torch/nn/parallel/distributed.py): the parameters
  in *definition* order, and the Reducer gets the list of buckets *reversed*.  So the last bucket
  built, holding the last-defined parameters, is bucket 0, and inside every bucket the
  parameters stay in forward order.  The caps are ``[sys.maxsize]`` (one bucket per dtype and
  device) unless ``find_unused_parameters=True``; then they are ``[first cap, cap]``, and the
  first cap lands on the *first-defined* parameters, the bucket that ends up last.
* **At the rebuild**, once, after the first iteration: the parameters in the order their
  gradients became ready, caps ``[first cap, cap]``, the list not reversed.  With
  ``find_unused_parameters=True`` (and no ``static_graph``) there is no rebuild: the
  construction layout is permanent (``Reducer::should_rebuild_buckets`` in reducer.hpp).

The rule itself: take the parameters in the given order; each (dtype, device) has one open
bucket; add the parameter, and close the bucket once it holds its cap *or more* (a parameter is
never split, so a bucket can end over its cap); the k-th bucket of a dtype gets ``caps[k]``, the
last cap repeating.  Buckets still open at the end come last.  Called from Python (the
construction), the result is sorted by the smallest position each bucket holds.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable

import torch.distributed as dist
from torch import nn

MiB = 2**20
DEFAULT_CAP_MB = 25  # native's bucket_cap_mb when left at None
FIRST_BUCKET_BYTES = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", MiB)  # 1 MiB in torch 2.13

NamedParams = list[tuple[str, nn.Parameter]]


def bucket_caps(bucket_cap_mb: float | None) -> tuple[int, int]:
    """(first bucket's cap, every later bucket's cap) in bytes, as native DDP computes them
    (distributed.py, ``_BucketCapacityConfig.create``): a small first bucket only at the default."""
    if bucket_cap_mb is None:
        return FIRST_BUCKET_BYTES, DEFAULT_CAP_MB * MiB
    cap = int(bucket_cap_mb * MiB)
    return cap, cap


# --8<-- [start:rule]
def pack_positions(items: list[tuple[Hashable, int]], caps: list[int],
                   sort_by_first: bool = False) -> list[list[int]]:
    """THE rule.  ``items``: (dtype-and-device key, bytes) in the order to pack; returns lists of
    positions in ``items``.  A bucket closes once it holds ``caps[k]`` bytes or more, k counting
    the buckets already closed for that key (the last cap repeats)."""
    closed: list[list[int]] = []
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}  # key -> (positions, bytes)
    closed_count: dict[Hashable, int] = {}
    for position, (key, nbytes) in enumerate(items):
        members, size = open_buckets.get(key, ([], 0))
        members, size = [*members, position], size + nbytes
        k = closed_count.get(key, 0)
        if size >= caps[min(k, len(caps) - 1)]:
            closed.append(members)
            closed_count[key], members, size = k + 1, [], 0
        open_buckets[key] = (members, size)
    buckets = closed + [members for members, _ in open_buckets.values() if members]
    return sorted(buckets, key=min) if sort_by_first else buckets
# --8<-- [end:rule]


def pack(named_params: NamedParams, caps: list[int],
         sort_by_first: bool = False) -> list[NamedParams]:
    """The rule on parameters, taken in the given order."""
    items = [((p.dtype, p.device), p.numel() * p.element_size()) for _, p in named_params]
    return [[named_params[i] for i in bucket]
            for bucket in pack_positions(items, caps, sort_by_first)]


# --8<-- [start:construction]
def construction_layout(named_params: NamedParams, bucket_cap_mb: float | None = None,
                        find_unused_parameters: bool = False) -> list[NamedParams]:
    """Native DDP's buckets when it is built: definition order, then the bucket list reversed."""
    first, cap = bucket_caps(bucket_cap_mb)
    caps = [first, cap] if first < cap else [cap]
    if not find_unused_parameters:  # it does not trust the definition order: one bucket
        caps = [sys.maxsize]
    return list(reversed(pack(named_params, caps, sort_by_first=True)))
# --8<-- [end:construction]


def first_iteration_layout(named_params: NamedParams) -> list[NamedParams]:
    """Before native DDP has seen a backward pass (``find_unused_parameters=False``): one bucket
    per dtype and device, parameters in definition order inside each."""
    return construction_layout(named_params)


def rebuilt_layout(ready_order: NamedParams,
                   bucket_cap_mb: float | None = None) -> list[NamedParams]:
    """Native DDP's buckets after the rebuild: the rule on the order gradients became ready."""
    return pack(ready_order, list(bucket_caps(bucket_cap_mb)))


def assign_buckets(named_params: NamedParams, cap_bytes: int) -> list[NamedParams]:
    """The rebuilt layout for one cap, assuming the gradients become ready in reverse
    definition order (what backward does for a plain stack of layers)."""
    return pack(list(reversed(named_params)), [cap_bytes])


def reverse_order_positions(sizes_bytes: list[int], cap_bytes: int) -> list[list[int]]:
    """``assign_buckets`` on bare sizes (one dtype and device): definition indices, bucket 0
    first.  The layout exercise 04.2 asks for."""
    last = len(sizes_bytes) - 1
    items = [("one dtype", size) for size in reversed(sizes_bytes)]
    return [[last - i for i in bucket] for bucket in pack_positions(items, [cap_bytes])]
