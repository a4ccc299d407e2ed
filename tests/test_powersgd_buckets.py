"""PowerSGD by hand over several buckets and odd buckets.

An overflow in one bucket makes the scaler skip the whole step and halve its scale, so no
bucket may keep a residual from that step; a bucket with no matrix worth compressing, or with a
0-dimensional parameter, is averaged whole."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddplab.powersgd import PowerSGDState, powersgd_hook

START, OVERFLOW, STEPS = 2, 5, 9


def two_bucket_model() -> nn.Module:
    """After DDP's rebuild (step 1) two buckets: the first (1 MiB cap, closed once past it)
    the last layer, ready first; the second the first layer, ready last."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16384))


def test_an_overflow_in_one_bucket_drops_every_buckets_residual(one_rank):
    model = two_bucket_model()
    ddp = DistributedDataParallel(model)
    state = PowerSGDState(rank=2, start_iter=START)
    seen: set[int] = set()

    def hook(state, bucket):
        seen.add(bucket.index())
        return powersgd_hook(state, bucket)

    ddp.register_comm_hook(state, hook)
    overflow = {"now": False}
    model[0].weight.register_hook(lambda g: g.fill_(float("inf")) if overflow["now"] else g)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    skipped, residuals_after_overflow = [], None
    for step in range(STEPS):
        overflow["now"] = step == OVERFLOW
        x, y = torch.randn(16, 32), torch.randint(0, 8, (16,))
        scaler.scale(F.cross_entropy(ddp(x), y)).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        opt.zero_grad(set_to_none=True)
        if step == OVERFLOW:
            residuals_after_overflow = dict(state.error)
    assert len(seen) == 2                      # the overflow hit one bucket of two
    assert residuals_after_overflow == {}      # the finite bucket's residual went too
    assert skipped == [step == OVERFLOW for step in range(STEPS)]
    assert set(state.error) == seen            # and error feedback is back after the skip


class Odd(nn.Module):
    """Parameters PowerSGD cannot compress: a scalar, a vector, a 2 × 2 matrix."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.small = nn.Linear(2, 2)

    def forward(self, x):
        return self.small(x) * self.scale


def test_a_bucket_without_a_matrix_to_compress_is_averaged_whole(one_rank):
    torch.manual_seed(0)
    model = Odd()
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(PowerSGDState(rank=2, start_iter=0), powersgd_hook)
    x = torch.randn(4, 2)
    ddp(x).sum().backward()
    expected = Odd()
    expected.load_state_dict(model.state_dict())
    expected(x).sum().backward()
    for ours, plain in zip(model.parameters(), expected.parameters(), strict=True):
        assert torch.equal(ours.grad, plain.grad)  # one rank: the average is the gradient
