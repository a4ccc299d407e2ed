"""The one packing rule (ddplab.buckets) against native DDP's own: its C++ function and its
Reducer's buckets, at construction and after the rebuild."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddplab.buckets import (
    MiB,
    construction_layout,
    pack_positions,
    rebuilt_layout,
    reverse_order_positions,
)
from ddplab.hooked_buckets import reverse_order_buckets
from exercises.grader import ch04
from exercises.grader.guard import Mistake

SIZE_LISTS = [([400, 12, 4000, 40, 1000, 8], 1000), ([4] * 10, 8), ([100, 200], 10_000),
              ([4096, 4096, 4], 4096), ([40, 40, 40], 1), ([8, 4000, 8, 8, 996, 4], 1000),
              ([1000, 4, 4, 1000], 1004)]


def natives_function(sizes: list[int], caps: list[int], reverse: bool) -> list[list[int]]:
    """dist._compute_bucket_assignment_by_size on float32 tensors of these byte sizes, as
    definition indices; ``reverse``: the tensors passed last to first (ready order)."""
    tensors = [torch.empty(s // 4) for s in sizes]
    order = list(reversed(range(len(sizes)))) if reverse else list(range(len(sizes)))
    buckets, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], caps)
    return [[order[i] for i in bucket] for bucket in buckets]


@pytest.mark.parametrize(("sizes", "cap"), SIZE_LISTS)
def test_rule_is_natives_function(sizes, cap):
    items = [("float32", s) for s in sizes]
    for caps in ([cap], [cap // 2 or 1, cap]):
        assert pack_positions(items, caps, sort_by_first=True) == natives_function(
            sizes, caps, reverse=False)


@pytest.mark.parametrize(("sizes", "cap"), SIZE_LISTS)
def test_exercise_04_2_expects_natives_rebuild_in_reverse_definition_order(sizes, cap):
    assert reverse_order_positions(sizes, cap) == natives_function(sizes, [cap], reverse=True)


def test_construction_and_rebuild_differ_for_the_reviewed_sizes():
    sizes = [400, 12, 4000, 40, 1000, 8]
    built = list(reversed(natives_function(sizes, [1000], reverse=False)))  # the Reducer's list
    assert built == [[5], [3, 4], [0, 1, 2]]   # forward order inside a bucket
    assert reverse_order_positions(sizes, 1000) == [[5, 4], [3, 2], [1, 0]]


class _Grader:
    """Just enough of the grader's Context to call check_buckets on a function."""

    def __init__(self, assign_buckets):
        self.learner = type("Learner", (), {"assign_buckets": staticmethod(assign_buckets)})

    @staticmethod
    def call(fn, *args):
        return fn(*args)


def test_grader_accepts_the_rebuild_and_rejects_the_construction_layout():
    ch04.check_buckets(_Grader(reverse_order_positions))
    construction = lambda sizes, cap: list(reversed(  # noqa: E731
        natives_function(sizes, [cap], reverse=False)))
    with pytest.raises(Mistake, match="layout at construction"):
        ch04.check_buckets(_Grader(construction))


def test_hooked_buckets_close_at_the_cap_or_over_it():
    layers = [nn.Linear(10, 10), nn.Linear(10, 1)]  # weight 400, bias 40, weight 40, bias 4 bytes
    params = [p for layer in layers for p in layer.parameters()]
    index = {id(p): i for i, p in enumerate(params)}

    def layout(cap_bytes):
        return [[index[id(p)] for p in b] for b in reverse_order_buckets(params, cap_bytes)]

    assert layout(44) == [[3, 2], [1, 0]]  # "close before exceeding" would give [[3, 2], [1], [0]]
    assert layout(50) == [[3, 2, 1], [0]]  # 84 bytes: native closes over the cap, not before


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(256, 512), nn.Linear(512, 512), nn.Linear(512, 10)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def reducer_buckets(ddp: DistributedDataParallel, names: dict) -> list[list[str]]:
    return [[names[p] for p in bucket.parameters()]
            for bucket in ddp.reducer._get_zeros_like_grad_buckets()]



@pytest.mark.parametrize("find_unused", [False, True])
def test_layouts_are_the_reducers_at_construction_and_after_the_rebuild(one_rank, find_unused):
    torch.manual_seed(0)
    model = Stack()
    named = list(model.named_parameters())
    names = {p: n for n, p in named}
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.5, find_unused_parameters=find_unused)
    want = [[n for n, _ in b] for b in construction_layout(named, 0.5, find_unused)]
    assert reducer_buckets(ddp, names) == want
    arrived = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: arrived.append(p)) for _, p in named]
    ddp(torch.randn(4, 256)).sum().backward()
    for handle in handles:
        handle.remove()
    ddp(torch.randn(4, 256)).sum().backward()  # the rebuild happens in this forward
    ready = [(names[p], p) for p in arrived]
    rebuilt = [[n for n, _ in b] for b in rebuilt_layout(ready, 0.5)]
    assert reducer_buckets(ddp, names) == (want if find_unused else rebuilt)
    assert find_unused or rebuilt != want  # the test can tell the two apart
    assert MiB // 2 < sum(p.numel() * 4 for _, p in named)  # several buckets to compare
