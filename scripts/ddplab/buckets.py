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
def pack_sizes(sizes: list[int], cap: int) -> list[list[int]]:
    """THE rule, for gradients of one dtype on one device: take them in the given order, add
    each to the open bucket, and close the bucket once it holds ``cap`` bytes or more.  A
    gradient is never split, so a bucket can end over the cap.  Returns positions in ``sizes``."""
    buckets, current, filled = [], [], 0
    for position, nbytes in enumerate(sizes):
        current.append(position)
        filled += nbytes
        if filled >= cap:
            buckets.append(current)
            current, filled = [], 0
    if current:  # the last bucket may stay under the cap
        buckets.append(current)
    return buckets
# --8<-- [end:rule]


# --8<-- [start:general]
def pack_with_caps(sizes: list[int], caps: list[int]) -> list[list[int]]:
    """``pack_sizes`` with the k-th bucket capped at ``caps[k]``, the last cap repeating."""
    buckets, start = [], 0
    for cap in caps[:-1]:
        if start < len(sizes):
            first = pack_sizes(sizes[start:], cap)[0]
            buckets.append([start + i for i in first])
            start += len(first)
    return buckets + [[start + i for i in b] for b in pack_sizes(sizes[start:], caps[-1])]


def pack_positions(items: list[tuple[Hashable, int]], caps: list[int],
                   sort_by_first: bool = False) -> list[list[int]]:
    """The rule for every dtype and device at once, as native's C++ applies it.  ``items``:
    (dtype-and-device key, bytes) in the order to pack; returns lists of positions in ``items``.
    Each key is packed on its own; the buckets come in the order they closed (a bucket closes
    at its last member), then the buckets still under their cap at the end, one per key."""
    by_key: dict[Hashable, list[int]] = {}  # in order of each key's first item
    for position, (key, _) in enumerate(items):
        by_key.setdefault(key, []).append(position)
    closed, still_open = [], []
    for positions in by_key.values():
        sizes = [items[p][1] for p in positions]
        for k, bucket in enumerate(pack_with_caps(sizes, caps)):
            full = sum(sizes[i] for i in bucket) >= caps[min(k, len(caps) - 1)]
            (closed if full else still_open).append([positions[i] for i in bucket])
    buckets = sorted(closed, key=max) + still_open
    return sorted(buckets, key=min) if sort_by_first else buckets
# --8<-- [end:general]


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


# --8<-- [start:first_iteration]
def first_iteration_layout(named_params: NamedParams) -> list[NamedParams]:
    """Native DDP's buckets until its first backward, at the default
    ``find_unused_parameters=False``: the definition order with no cap (a cap of
    ``sys.maxsize``), so one bucket per dtype and device, parameters in definition order inside
    it.  A model of one dtype on one device: one bucket holding every parameter."""
    return construction_layout(named_params, find_unused_parameters=False)
# --8<-- [end:first_iteration]


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
    return [[last - i for i in bucket] for bucket in pack_sizes(sizes_bytes[::-1], cap_bytes)]
