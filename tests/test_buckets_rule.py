"""The packing rule stated once for one dtype and one cap (``pack_sizes``, what page 04 shows),
and the general packing built around it: several dtypes and a small first cap, against native
DDP's own function."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddplab.buckets import pack_positions, pack_sizes

DTYPES = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16}
MIXED = [("f32", 400), ("f64", 16), ("f32", 4000), ("f16", 40), ("f64", 1000), ("f32", 8),
         ("f16", 1000), ("f64", 8), ("f32", 12)]


def natives_buckets(items: list[tuple[str, int]], caps: list[int]) -> list[list[int]]:
    tensors = [torch.empty(nbytes // DTYPES[key].itemsize, dtype=DTYPES[key])
               for key, nbytes in items]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, caps)
    return [list(bucket) for bucket in buckets]


def test_one_cap_closes_a_bucket_at_the_cap_or_more_and_never_splits():
    assert pack_sizes([400, 12, 4000, 40, 1000, 8], 1000) == [[0, 1, 2], [3, 4], [5]]
    assert pack_sizes([1000, 1000], 1000) == [[0], [1]]
    assert pack_sizes([], 1000) == []


@pytest.mark.parametrize("caps", [[1000], [100, 1000], [8], [10_000], [500, 2000]])
def test_several_dtypes_and_a_first_cap_pack_as_natives_function(caps):
    assert pack_positions(MIXED, caps, sort_by_first=True) == natives_buckets(MIXED, caps)


def test_one_dtype_and_one_cap_is_the_rule_itself():
    sizes = [size for _, size in MIXED]
    assert pack_positions([("f32", s) for s in sizes], [1000]) == pack_sizes(sizes, 1000)
