"""Communication hooks on BucketedDDP and native DDP (gloo, CPU ranks).

Bounds: at 2 ranks every hook here works element by element (cast, divide, a sum of two numbers,
which does not depend on order), so the same hook on both DDPs gives the same bits.  At 3 ranks
gloo's ring adds three contributions in an order that depends on where an element sits in its
bucket, and the two DDPs lay their buckets out differently: the results agree to the rounding of
the type on the wire (float32: 1e-6 relative; float16: 2⁻¹⁰; bfloat16: 2⁻⁷, plus the float32
rounding of the division), which is what the 3-rank test asserts.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from test_naive_ddp import launch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as NativeDDP

from ddplab import BucketedDDP
from ddplab.comm_hooks import bf16_hook, count_bytes, fp16_hook
from ddplab.powersgd import PowerSGDState, powersgd_hook

SHAPES = [(16, 8), (16,), (32, 16), (32,), (4, 32), (4,)]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def bf16_renamed(process_group, bucket):
    """Native DDP refuses torch's bf16_compress_hook *by name* without CUDA + NCCL."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


HOOKS = {"torch_allreduce": default_hooks.allreduce_hook,
         "torch_fp16": default_hooks.fp16_compress_hook, "torch_bf16": bf16_renamed,
         "our_fp16": fp16_hook, "our_bf16": bf16_hook}


def grads_after_one_step(ddp: nn.Module, rank: int) -> list[torch.Tensor]:
    torch.manual_seed(100 + rank)               # a different batch on each rank
    ddp(torch.randn(16, 8)).pow(2).sum().backward()
    return [p.grad.clone() for p in ddp.module.parameters()]


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b, strict=True))


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(),
                                                          strict=True))


def hook_checks(ctx, args) -> dict:
    torch.manual_seed(0)
    model, out = mlp(), {}
    for name, hook in HOOKS.items():  # the same hook on both, one backward, 2-element buckets
        ours, theirs = BucketedDDP(copy.deepcopy(model), bucket_cap_mb=0.001), NativeDDP(
            copy.deepcopy(model), bucket_cap_mb=0.001)
        ours.register_comm_hook(None, hook)
        theirs.register_comm_hook(None, hook)
        out[name] = rel_diff(grads_after_one_step(ours, ctx.rank),
                             grads_after_one_step(theirs, ctx.rank))
    if ctx.world_size == 2:
        out.update(contract_checks(ctx, model))
    return out


def contract_checks(ctx, model) -> dict:
    out = {}
    seen = []

    def spy(state, bucket):  # what a hook is handed, then the plain average
        local = [p.grad for p in bucket.parameters()]
        seen.append({"index": bucket.index(), "last": bucket.is_last(),
                     "undivided": all(torch.equal(g, v) for g, v in
                                      zip(local, bucket.gradients(), strict=True)),
                     "views_of_buffer": all(g.untyped_storage().data_ptr() ==
                                            bucket.buffer().untyped_storage().data_ptr()
                                            for g in bucket.gradients()),
                     "shapes": [tuple(p.shape) for p in bucket.parameters()]})
        return default_hooks.allreduce_hook(state, bucket)
    ddp = BucketedDDP(copy.deepcopy(model), bucket_cap_mb=1e-6)  # one parameter per bucket
    ddp.register_comm_hook(None, spy)
    grads_after_one_step(ddp, ctx.rank)
    out["seen_first_iteration"] = list(seen)  # native's first iteration: one bucket
    seen.clear()
    grads_after_one_step(ddp, ctx.rank)  # rebuilt at the cap: one parameter per bucket
    out["seen"] = seen
    try:
        ddp.register_comm_hook(None, spy)
    except RuntimeError as err:
        out["twice"] = str(err)
    ddp = BucketedDDP(copy.deepcopy(model))
    ddp.register_comm_hook(None, lambda state, bucket: bucket.buffer())
    try:
        grads_after_one_step(ddp, ctx.rank)
    except TypeError as err:
        out["not_a_future"] = str(err)
    dist.barrier()
    # Bytes handed to all_reduce in one step, per hook (one bucket: the whole gradient).
    numel = sum(p.numel() for p in model.parameters())
    out["numel"] = numel
    for name, state, hook in (("none", None, None), ("fp16", None, fp16_hook),
                              ("bf16", None, bf16_hook),
                              ("powersgd", PowerSGDState(rank=2, start_iter=0), powersgd_hook)):
        ddp = BucketedDDP(copy.deepcopy(model), bucket_cap_mb=100)
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        with count_bytes() as counted:
            grads_after_one_step(ddp, ctx.rank)
        out[f"bytes_{name}"] = (counted.calls, counted.payload_bytes)
    out["powersgd"] = {2: powersgd_vs_torch(model, 2, steps=6),   # 4 compressed steps
                       4: powersgd_vs_torch(model, 4, steps=3)}   # 1 compressed step
    return out


def powersgd_vs_torch(model: nn.Module, rank: int, steps: int) -> float:
    """Ours and torch's, both on native DDP (one bucket: see chapter09_compression.py)."""
    ours, theirs = (NativeDDP(copy.deepcopy(model), bucket_cap_mb=100) for _ in range(2))
    ours.register_comm_hook(PowerSGDState(rank=rank, start_iter=2), powersgd_hook)
    theirs.register_comm_hook(torch_powersgd.PowerSGDState(
        None, matrix_approximation_rank=rank, start_powerSGD_iter=2, min_compression_rate=2,
        use_error_feedback=True, warm_start=True, random_seed=0), torch_powersgd.powerSGD_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(steps):
        for ddp, opt in zip((ours, theirs), opts, strict=True):
            torch.manual_seed(1000 * step + dist.get_rank())
            ddp(torch.randn(16, 8)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    return max_diff(ours.module, theirs.module)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch(hook_checks, 2, tmp_path_factory.mktemp("hooks2"), timeout=120)


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_the_same_hook_on_both_ddps_gives_the_same_bits_on_two_ranks(two_ranks, hook):
    assert two_ranks[hook] == 0.0


def test_the_bucket_has_gradbuckets_methods_and_undivided_gradients(two_ranks):
    first = two_ranks["seen_first_iteration"]  # like native: one bucket before the rebuild
    assert [(s["index"], s["last"], len(s["shapes"])) for s in first] == [(0, True, len(SHAPES))]
    seen = two_ranks["seen"]
    assert [s["index"] for s in seen] == list(range(len(SHAPES)))     # one parameter each
    assert [s["last"] for s in seen] == [False] * (len(SHAPES) - 1) + [True]
    assert [s["shapes"][0] for s in seen] == SHAPES[::-1]             # last layer first
    assert all(s["undivided"] and s["views_of_buffer"] for s in seen)


def test_clear_errors_for_a_second_hook_and_for_a_hook_without_a_future(two_ranks):
    assert "only be called once" in two_ranks["twice"]
    assert "must return a torch.futures.Future, got Tensor" in two_ranks["not_a_future"]


def test_bytes_on_the_wire_are_counted_per_hook(two_ranks):
    numel = two_ranks["numel"]
    assert tuple(two_ranks["bytes_none"]) == (1, 4 * numel)
    assert tuple(two_ranks["bytes_fp16"]) == (1, 2 * numel)
    assert tuple(two_ranks["bytes_bf16"]) == (1, 2 * numel)
    # PowerSGD r=2, torch's rule "compress if n·m > 2·r(n+m)": 4×32 (128 <= 144) and the
    # biases go whole; 16×8 becomes P 16×2 + Q 8×2, 32×16 P 32×2 + Q 16×2.  Three calls.
    whole = 4 * 32 + 16 + 32 + 4
    low_rank = (16 + 8) * 2 + (32 + 16) * 2
    assert tuple(two_ranks["bytes_powersgd"]) == (3, 4 * (whole + low_rank))


def test_hand_written_powersgd_equals_torchs(two_ranks):
    # Rank 2: both use Gram-Schmidt, the same random start (numpy RandomState(0) -> seed) and
    # the same operations (bmm): equal bits, step after step.  Rank 4: torch orthogonalises
    # with Householder QR (torch.linalg.qr) instead, which rounds differently (and may flip a
    # column's sign, which P Qᵀ does not see): after one compressed step they agree to float32
    # rounding (2e-7 seen).  Like any rounding difference, it grows as training goes on
    # (7e-4 after four compressed steps of this toy model), so the bound is for one step.
    assert two_ranks["powersgd"][2] == 0.0
    assert two_ranks["powersgd"][4] < 1e-6


@pytest.mark.slow
def test_three_ranks_agree_to_the_rounding_of_the_type_on_the_wire(tmp_path):
    three = launch(hook_checks, 3, tmp_path, timeout=120)
    assert three["torch_allreduce"] < 1e-6
    assert three["torch_fp16"] < 2**-10 and three["our_fp16"] < 2**-10
    assert three["torch_bf16"] < 2**-7 and three["our_bf16"] < 2**-7
