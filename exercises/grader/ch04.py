"""Chapter 04: autograd hooks — the ready order, native DDP's buckets, a hook that scales."""

from __future__ import annotations

import torch
from torch import nn

from ddplab.buckets import pack_positions, reverse_order_positions

from .core import Context, Exercise
from .guard import Mistake


class Crossing(nn.Module):
    """A model whose ready order is NOT the reverse of its definition order: `late` is defined
    first but used last, and `skip` feeds the output directly (its gradient is ready early)."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(6, 3)
        self.first = nn.Linear(4, 6)
        self.middle = nn.Linear(6, 6)
        self.skip = nn.Linear(4, 3)

    def forward(self, x):
        return self.late(torch.tanh(self.middle(torch.tanh(self.first(x))))) + self.skip(x)


def _loss(model: nn.Module) -> torch.Tensor:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    return model(x).pow(2).mean()


def _reference_order(model: nn.Module) -> list[str]:
    order, handles = [], []
    for name, p in model.named_parameters():
        handles.append(p.register_post_accumulate_grad_hook(lambda p, n=name: order.append(n)))
    _loss(model).backward()
    for h in handles:
        h.remove()
    return order


def check_ready_order(ctx: Context) -> None:
    torch.manual_seed(0)
    model = Crossing()
    want = _reference_order(model)
    model.zero_grad(set_to_none=True)
    got = ctx.call(ctx.learner.ready_order, model, _loss(model))
    names = [n for n, _ in model.named_parameters()]
    if list(got) != want:
        hint = ("That is the reverse of the definition order, a guess: here `late` is defined "
                "first but used last. Record the order with hooks."
                if list(got) == names[::-1] else
                "Record each name from a hook when that parameter's gradient is accumulated "
                "(register_post_accumulate_grad_hook).")
        raise Mistake(f"ready_order returned {list(got)}, the gradients became ready in the order "
                      f"{want}. {hint}")
    for name, p in model.named_parameters():
        if p.grad is None:
            raise Mistake(f"after ready_order, '{name}' has no gradient: run loss.backward()")
        if getattr(p, "_post_accumulate_grad_hooks", None):
            raise Mistake(f"after ready_order, '{name}' still has a hook: remove each hook "
                          "(handle.remove()) so the next backward is not traced too")


def check_buckets(ctx: Context) -> None:
    """Native DDP's layout after its rebuild, for gradients that arrive in reverse definition
    order: ddplab.buckets' rule, which tests/test_buckets.py pins to the reducer's own
    dist._compute_bucket_assignment_by_size."""
    cases = [([400, 12, 4000, 40, 1000, 8], 1000), ([4] * 10, 8), ([100, 200], 10_000),
             ([4096, 4096, 4], 4096), ([40, 40, 40], 1)]
    for sizes, cap in cases:
        want = reverse_order_positions(sizes, cap)
        got = ctx.call(ctx.learner.assign_buckets, list(sizes), cap)
        got = [list(b) for b in got]
        if got != want:
            flat = sorted(i for b in got for i in b)
            built = list(reversed(pack_positions([("", s) for s in sizes], [cap],
                                                 sort_by_first=True)))
            if got == built:
                hint = ("that is native's layout at construction (with find_unused_parameters="
                        "True: definition order, then the list of buckets reversed); 04.2 asks "
                        "for the rebuilt one, packed from the last parameter to the first")
            elif flat != list(range(len(sizes))):
                hint = ("some parameters are in no bucket (or in two): the last bucket, not "
                        "full yet, must be kept too")
            elif got and got[0] and got[0][0] == 0:
                hint = ("fill the buckets in reverse order: the last parameter's gradient is "
                        "ready first")
            else:
                hint = ("a bucket closes once it holds cap_bytes or more, after adding the "
                        "parameter that reaches the cap (native DDP's rule, so a bucket may end "
                        "over the cap), never before adding it")
            raise Mistake(f"assign_buckets({sizes}, cap_bytes={cap}) = {got}, native DDP's "
                          f"rebuild makes {want} (gradients ready last to first): {hint}")


def check_scaler(ctx: Context) -> None:
    torch.manual_seed(1)
    model, twin = Crossing(), Crossing()
    twin.load_state_dict(model.state_dict())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ctx.call(ctx.learner.scale_gradients, model, 0.25)
    _loss(model).backward()
    (_loss(twin) * 0.25).backward()  # scaling by a power of two is exact: bitwise comparable
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        if not torch.equal(p.detach(), before[name]):
            raise Mistake(f"backward changed the parameter '{name}' itself: "
                          "register_post_accumulate_grad_hook hands your hook the parameter, "
                          "not the gradient; scale param.grad")
        if not torch.equal(p.grad, q.grad):
            ratio = float((p.grad / q.grad).nanmean())
            raise Mistake(f"'{name}'.grad is {ratio * 0.25:.3g}× the plain gradient, expected "
                          "0.25×" + (": was it scaled twice?" if abs(ratio - 0.25) < 1e-3 else ""))


EXERCISES = [
    Exercise("04.1", "ready_order", check_ready_order, world_sizes=(1,)),
    Exercise("04.2", "assign_buckets", check_buckets, world_sizes=(1,)),
    Exercise("04.3", "scale_gradients", check_scaler, world_sizes=(1,)),
]
