"""PowerSGD with a GradScaler: one overflow must cost one step, not the rest of training.

Native DDP, one gloo rank, a GradScaler with its usual semantics (a step whose gradients hold
inf/NaN is skipped and the scale halves).  Step ``OVERFLOW`` gets an inf in its input, as an
fp16 overflow would give.  Our hook forgets its residual and warm start on that step and trains
on; torch 2.13's ``powerSGD_hook`` keeps them, and the test records what it does: measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel

from ddplab.powersgd import PowerSGDState, powersgd_hook

START, OVERFLOW, STEPS = 2, 5, 12



def ours():
    return PowerSGDState(rank=2, start_iter=START), powersgd_hook


def torchs():
    state = torch_powersgd.PowerSGDState(None, matrix_approximation_rank=2,
                                         start_powerSGD_iter=START, min_compression_rate=2,
                                         use_error_feedback=True, warm_start=True)
    return state, torch_powersgd.powerSGD_hook


def train(make_hook) -> tuple[list[bool], nn.Module]:
    """Which steps the scaler skipped, and the model after ``STEPS`` steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(*make_hook())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    skipped = []
    for step in range(STEPS):
        x, y = torch.randn(16, 32), torch.randint(0, 8, (16,))
        if step == OVERFLOW:
            x[0, 0] = float("inf")      # what an fp16 overflow hands backward
        scaler.scale(F.cross_entropy(ddp(x), y)).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)   # update() halves the scale on a skip
        opt.zero_grad(set_to_none=True)
    return skipped, model


def test_our_powersgd_skips_only_the_overflowing_step(one_rank):
    skipped, model = train(ours)
    assert skipped == [step == OVERFLOW for step in range(STEPS)]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_torch_powersgd_hook_never_recovers_from_one_overflow(one_rank):
    """What the page says of torch 2.13's hook; if this fails, torch has learnt to recover."""
    skipped, _ = train(torchs)
    assert skipped == [step >= OVERFLOW for step in range(STEPS)]


def test_without_the_guard_ours_would_not_recover_either(one_rank, monkeypatch):
    """The guard is what makes the difference: told every gradient is finite, ours keeps the
    NaN in its residual and its Q, as torch's does, and skips from then on."""
    import ddplab.powersgd as powersgd
    monkeypatch.setattr(powersgd.torch, "isfinite", lambda t: torch.ones_like(t, dtype=bool))
    skipped, _ = train(ours)
    assert skipped == [step >= OVERFLOW for step in range(STEPS)]
