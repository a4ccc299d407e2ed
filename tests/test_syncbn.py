"""ddplab.SyncBatchNorm: statistics over every rank, checked against one process on the whole
batch (2 gloo ranks, shards of 3 and 5 samples: unequal on purpose)."""

from __future__ import annotations

import bubble_workers
import pytest
import torch
from conftest import launch_forked
from torch import nn

import ddplab
from ddplab import syncbn

# float32 rounding, nothing more: the statistics are summed in float64, outputs and input
# gradients are O(1) (float32 steps ~1e-7); the parameter gradients are sums of up to 160
# terms of size ~10 (steps ~1e-6 each).  A wrong formula is off by 1e-2 or more.
TOL = {"output": 1e-5, "input_grad": 1e-5, "param_grad_sum": 1e-4, "running_mean": 1e-5,
       "running_var": 1e-5, "eval_output": 1e-5}


@pytest.fixture(scope="module")
def diffs(tmp_path_factory):
    out = tmp_path_factory.mktemp("syncbn")
    args = ddplab.parse_chapter_args(ddplab.chapter_parser("test"),
                                     ["--world-size", "2", "--out", str(out)])
    return launch_forked(bubble_workers.syncbn_against_full_batch, args).result


@pytest.mark.parametrize("dims", ["1d", "2d"])
@pytest.mark.parametrize("what", list(TOL))
def test_matches_batchnorm_on_the_whole_batch(diffs, dims, what):
    assert diffs[dims]["is_sync"]
    assert diffs[dims][what] < TOL[what]


def test_convert_keeps_state_and_replaces_every_batchnorm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(2)))
    model[1].running_mean.fill_(0.5)
    converted = syncbn.convert_sync_batchnorm(model)
    assert isinstance(converted[1], syncbn.SyncBatchNorm)
    assert isinstance(converted[2][0], syncbn.SyncBatchNorm)
    assert torch.equal(converted[1].running_mean, torch.full((4,), 0.5))


def test_without_a_process_group_it_is_plain_batchnorm():
    torch.manual_seed(0)
    x = torch.randn(8, 3)
    plain = nn.BatchNorm1d(3)
    sync = syncbn.convert_sync_batchnorm(nn.BatchNorm1d(3))
    assert torch.allclose(sync(x), plain(x))
    assert torch.allclose(sync.running_var, plain.running_var)


def test_rejects_what_it_does_not_implement():
    with pytest.raises(ValueError, match="affine=True"):
        syncbn.SyncBatchNorm(4, affine=False)
    with pytest.raises(ValueError, match="at least 2D"):
        syncbn.SyncBatchNorm(4)._check_input_dim(torch.zeros(4))
