"""Chapter 11: sharding, graded on 3 ranks against torch's ZeroRedundancyOptimizer and fully_shard.

Everything is compared bit for bit, and on 3 ranks only: at 2 ranks an element's sum has two
terms, a + b == b + a, and halving is exact, so a message laid out in another order or a
gradient divided before the reduction still gives fully_shard's bits.  At 3 ranks neither does:
gloo's reduce-scatter all-reduces the whole message and keeps a chunk, and its ring adds an
element's three terms in an order set by the element's offset in the message
(``ddplab/fsdp.py`` says which), and dividing by 3 rounds.

A wrong result is explained by recomputing the likely mistakes here (the grader's own
collectives, never the learner's code) and saying which one the learner's result equals.
"""

from __future__ import annotations

import copy
import math
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as NativeDDP

from .core import REPO, Context, Exercise
from .guard import Mistake

sys.path.insert(0, str(REPO / "scripts"))  # the book's library: the ledger's measure, layouts
from ddplab.fsdp_layout import offsets, parameter_major, shard, shard_rows, split_shards
from ddplab.memory_ledger import measure

ADAMW = {"lr": 0.05, "weight_decay": 0.1}


def make_model() -> nn.Module:
    """Dim-0 sizes 10, 10, 5, 4: none divides by 3, and 4 rows over 3 ranks are 2, 2, 0."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 10), nn.ReLU(), nn.LayerNorm(10), nn.Linear(10, 5),
                         nn.ReLU(), nn.Linear(5, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 7, generator=gen), torch.randint(0, 4, (6,), generator=gen)


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def fully_sharded(module: nn.Module) -> nn.Module:
    """``fully_shard`` on every layer with parameters, then on the root (FSDP2 on a CPU mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    return fully_shard(module, mesh=mesh)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def first_of_every_rank(ctx: Context, problem: str | None) -> None:
    """Raise, on every rank, the first rank's problem (so no rank goes on alone)."""
    problems = ctx.gather(problem)
    for rank, text in enumerate(problems):
        if text:
            raise Mistake(text if text.startswith("rank ") else f"rank {rank}: {text}")


# ---------------------------------------------------------------- 11.1 the owner map
OWNER_CASES = ([70, 10, 10, 10, 50, 5, 20, 4],  # this chapter's model, parameter by parameter
               [6, 6, 6, 6, 2],                 # equal sizes: which one goes first?
               [1000, 1, 2, 3, 500, 499],
               [5, 3])                          # fewer parameters than ranks


def native_owners(sizes: list[int], world: int) -> list[int]:
    params = [torch.zeros(n) for n in sizes]
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
    where = {id(p): rank for rank, groups in enumerate(zero._partition_parameters())
             for group in groups for p in group["params"]}
    return [where[id(p)] for p in params]


def greedy(sizes: list[int], world: int, order: list[int], last_tie: bool = False,
           count_params: bool = False) -> list[int]:
    owner, totals = [0] * len(sizes), [0] * world
    for i in order:
        low = min(totals)
        rank = (world - 1 - totals[::-1].index(low)) if last_tie else totals.index(low)
        owner[i] = rank
        totals[rank] += 1 if count_params else sizes[i]
    return owner


def owner_mistakes(sizes: list[int], world: int) -> dict[str, list[int]]:
    """The maps the likely mistakes give, with what to say about each."""
    ids = list(range(len(sizes)))
    largest = sorted(ids, key=lambda i: sizes[i], reverse=True)
    return {
        "it is the greedy split with the smallest parameters first: take them largest first "
        "(sorted by numel, reverse=True), so the big ones spread out before the small ones fill "
        "the gaps": greedy(sizes, world, sorted(ids, key=lambda i: sizes[i])),
        "it is the greedy split in the model's order: sort the parameters by size, largest "
        "first, before handing them out": greedy(sizes, world, ids),
        "it deals the parameters out in turn (round robin): give each one to the rank that owns "
        "the fewest elements so far instead": [largest.index(i) % world for i in ids],
        "a tie goes to the last of the ranks with the fewest elements: torch takes the first "
        "(totals.index(min(totals)))": greedy(sizes, world, largest, last_tie=True),
        "equal sizes are taken in reverse order: sort with reverse=True (a stable sort keeps "
        "their order), not by reversing an ascending sort": greedy(sizes, world,
                                                                   largest_unstable(sizes)),
        "it balances the number of parameters: balance the number of elements":
            greedy(sizes, world, largest, count_params=True),
    }


def largest_unstable(sizes: list[int]) -> list[int]:
    return list(reversed(sorted(range(len(sizes)), key=lambda i: sizes[i])))


def check_owners(ctx: Context) -> None:
    world = ctx.world_size
    for sizes in OWNER_CASES:
        want = native_owners(sizes, world)
        got = ctx.call(ctx.learner.owners, list(sizes), world)
        where = f"owners({sizes}, {world})"
        if not isinstance(got, (list, tuple)) or len(got) != len(sizes):
            raise Mistake(f"{where} returned {got!r}: return a list with one rank per parameter")
        if any(not isinstance(r, int) or not 0 <= r < world for r in got):
            raise Mistake(f"{where} returned {list(got)}: every owner must be a rank, 0 to "
                          f"{world - 1}")
        got = list(got)
        if got == want:
            continue
        i = next(k for k in range(len(sizes)) if got[k] != want[k])
        cause = next((why for why, owner in owner_mistakes(sizes, world).items()
                      if owner == got), "")
        raise Mistake(f"{where} = {got}; ZeroRedundancyOptimizer's is {want}: parameter {i} "
                      f"({sizes[i]} elements) is rank {want[i]}'s, yours gives it to rank "
                      f"{got[i]}" + (f". Your map is that of a known mistake: {cause}" if cause
                                     else ""))


# ---------------------------------------------------------------- 11.2 ZeRO-1
def check_zero1(ctx: Context) -> None:
    start = make_model()
    mine, theirs = copy.deepcopy(start), copy.deepcopy(start)
    names = [n for n, _ in mine.named_parameters()]
    mine_ddp, their_ddp = NativeDDP(mine), NativeDDP(theirs)
    opt = ctx.call(ctx.learner.ShardedOptimizer, mine.parameters(), torch.optim.AdamW, **ADAMW)
    native = ZeroRedundancyOptimizer(theirs.parameters(), torch.optim.AdamW, **ADAMW)
    owner = native_owners([p.numel() for p in theirs.parameters()], ctx.world_size)
    first_of_every_rank(ctx, ownership_problem(ctx, opt, list(mine.parameters()), names, owner))
    for step in range(3):
        x, y = batch(ctx.rank, step)
        for model, ddp in ((mine, mine_ddp), (theirs, their_ddp)):
            for p in model.parameters():
                p.grad = None
            loss_of(ddp, x, y).backward()
        before = [p.detach().clone() for p in mine.parameters()]
        ctx.call(opt.step)
        native.step()
        compare_parameters(ctx, mine, theirs, before, names, owner, step)
    first_of_every_rank(ctx, state_problem(ctx, opt, mine, theirs, native, names))


def ownership_problem(ctx, opt, params, names, owner) -> str | None:
    optim = getattr(opt, "optim", None)
    if not isinstance(optim, torch.optim.Optimizer):
        return ("keep this rank's optimizer as `self.optim` (optimizer_class built on the "
                f"parameters this rank owns); found {type(optim).__name__}")
    index = {id(p): i for i, p in enumerate(params)}
    held = sorted(index[id(p)] for g in optim.param_groups for p in g["params"] if id(p) in index)
    want = [i for i, r in enumerate(owner) if r == ctx.rank]
    if held == want:
        return None
    if len(held) == len(params):
        return (f"self.optim holds all {len(params)} parameters: every rank would keep the whole "
                "optimizer state, as under DDP. Build it on the parameters this rank owns only "
                f"({', '.join(names[i] for i in want) or 'none'})")
    return (f"self.optim holds {[names[i] for i in held]}, ZeroRedundancyOptimizer gives this "
            f"rank {[names[i] for i in want]}: take the owners from exercise 11.1")


def compare_parameters(ctx, mine, theirs, before, names, owner, step) -> None:
    flags = [(torch.equal(p, q), torch.equal(p, b)) for p, q, b in
             zip(mine.parameters(), theirs.parameters(), before, strict=True)]
    every = ctx.gather(flags)
    for i, name in enumerate(names):
        wrong = [r for r, f in enumerate(every) if not f[i][0]]
        if not wrong:
            continue
        old = [r for r, f in enumerate(every) if f[i][1] and not f[i][0]]
        head = (f"after step {step + 1}, parameter '{name}' (owned by rank {owner[i]}) differs "
                f"from DDP + ZeroRedundancyOptimizer's on rank{'s' if len(wrong) > 1 else ''} "
                f"{', '.join(map(str, wrong))}")
        if set(old) == set(range(ctx.world_size)):
            cause = ("every rank, its owner too, still holds its value from before the step: "
                     f"the owner's new value was overwritten. Broadcast it from its owner "
                     f"(src=rank {owner[i]}), not from rank 0")
        elif old and owner[i] not in wrong:
            cause = (f"rank{'s' if len(old) > 1 else ''} {', '.join(map(str, old))} still hold "
                     f"its value from before the step; its owner has the new one. After "
                     "stepping, every rank must receive each parameter from its owner "
                     "(dist.broadcast(p, src=owner), called on every rank)")
        elif owner[i] in wrong:
            cause = ("its owner computed another update: step self.optim on the averaged "
                     "gradients as they are (DDP already averaged them)")
        else:
            cause = "the replicas no longer agree"
        raise Mistake(f"{head}: {cause}")


def state_problem(ctx, opt, mine, theirs, native, names) -> str | None:
    pairs = dict(zip(map(id, mine.parameters()), theirs.parameters(), strict=True))
    for name, p in zip(names, mine.parameters(), strict=True):
        if p not in opt.optim.state:
            continue
        q = pairs[id(p)]
        for key in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(opt.optim.state[p][key], native.optim.state[q][key]):
                return (f"AdamW's {key} of '{name}' differs from ZeroRedundancyOptimizer's: step "
                        "self.optim once per step() on the averaged gradients")
    return None


# ---------------------------------------------------------------- 11.3 the reduce-scatter
def check_reduce_scatter(ctx: Context) -> None:
    start = make_model()
    plain, theirs = copy.deepcopy(start), fully_sharded(copy.deepcopy(start))
    x, y = batch(ctx.rank, 0)
    loss_of(plain, x, y).backward()
    loss_of(theirs, x, y).backward()
    for index, unit in enumerate(plain):
        names = [f"{index}.{n}" for n, _ in unit.named_parameters()]
        if not names:
            continue
        grads = [p.grad.clone() for p in unit.parameters()]
        want = [local(q.grad) for q in theirs[index].parameters()]
        got = ctx.call(ctx.learner.reduce_scatter_gradients, [g.clone() for g in grads])
        first_of_every_rank(ctx, shape_problem(got, want, names))
        if all(ctx.gather(all(torch.equal(a, b) for a, b in zip(got, want, strict=True)))):
            continue
        first_of_every_rank(ctx, layout_problem(ctx, got, want, grads, names))


def shape_problem(got, want, names) -> str | None:
    if not isinstance(got, (list, tuple)) or len(got) != len(want):
        return (f"for the unit with {names}, return a list of {len(want)} tensors (this rank's "
                f"shard of each gradient); got {type(got).__name__}")
    for name, a, b in zip(names, got, want, strict=True):
        if not torch.is_tensor(a) or a.shape != b.shape or a.dtype != b.dtype:
            what = f"{a.dtype} of shape {tuple(a.shape)}" if torch.is_tensor(a) else \
                type(a).__name__
            return (f"your shard of '{name}' is {what}; fully_shard's on this rank is {b.dtype} "
                    f"of shape {tuple(b.shape)}: rows rank·c to (rank+1)·c of dim 0, with "
                    "c = ceil(d0 / world_size), as torch.chunk cuts it")
    return None


def layout_problem(ctx, got, want, grads, names) -> str | None:
    """Every rank recomputes the likely mistakes (collectives, so all of them); a rank whose
    result is wrong names the one it equals."""
    candidates, exact = mistaken_results(ctx, grads)
    for name, a, b, k in zip(names, got, want, range(len(names)), strict=True):
        if torch.equal(a, b):
            continue
        bad = int((a != b).view(-1).nonzero()[0])
        head = (f"'{name}', element {bad} of your shard: {a.view(-1)[bad].item():.9g}, "
                f"fully_shard's {b.view(-1)[bad].item():.9g}")
        for why, shards in candidates.items():
            if all(torch.equal(x, y) for x, y in zip(got, shards, strict=True)):
                return f"{head}. {why(k, bad)}"
        off = (a.double() - exact[k]).abs().max().item()
        if off <= ctx.world_size * torch.finfo(torch.float32).eps * exact[k].abs().max().item():
            return (f"{head}. Within float32 rounding of the exact average: the right numbers, "
                    "added in another order than fully_shard's. Lay the message out shard-major "
                    "(row r = rank r's padded chunk of every gradient) and reduce it with AVG")
        return f"{head}. Off by {off:.3g} from the exact average."
    return None


def mistaken_results(ctx: Context, grads: list[torch.Tensor]) -> tuple[dict, list]:
    """What each likely mistake gives on this rank ({explanation(param, element): shards}), and
    the exact average of this rank's shards (float64)."""
    world, rank = ctx.world_size, ctx.rank
    shapes = [g.shape for g in grads]
    every = ctx.gather([g.clone() for g in grads])
    exact = [torch.stack([shard(e[k], rank, world) for e in every]).double().mean(0)
             for k in range(len(grads))]

    def reduce(message: torch.Tensor, op) -> list[torch.Tensor]:
        row = message.new_empty(message.shape[1])
        dist.reduce_scatter_single(row, message.reshape(-1), op=op)
        return split_shards(row, shapes, rank, world)

    shard_major = torch._chunk_cat(grads, dim=0, num_chunks=world)
    flat = parameter_major(grads, world)
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    sizes = [-(-s[0] // world) * world * math.prod(s[1:]) for s in shapes]
    flat_shards = [shard(t.view(-1, *s[1:])[:s[0]], rank, world)
                   for t, s in zip(flat.split(sizes), shapes, strict=True)]
    correct_row = shard_major.new_empty(shard_major.shape[1])
    dist.reduce_scatter_single(correct_row, shard_major.reshape(-1), op=dist.ReduceOp.AVG)

    def moved(k, element):
        where = offsets(shapes, k, rank * -(-shapes[k][0] // world) * math.prod(shapes[k][1:])
                        + element, world)
        return (f"The same average, its {world} terms added in another order: in your flat "
                f"message (whole gradients one after the other, as a DDP bucket) this element "
                f"sits at offset {where['parameter_major']}, in fully_shard's at "
                f"{where['shard_major']}, and gloo's ring adds an element's terms in an order "
                "set by its offset. Lay the message out shard-major: row r = rank r's padded "
                "chunk of every gradient in turn (torch._chunk_cat), then reduce-scatter it")

    return {
        moved: flat_shards,
        lambda k, e: (f"Each gradient was divided by {world} before the reduction: at 3 ranks "
                      "that rounds each term first, so the sum differs in the last bits "
                      "(at 2 ranks halving is exact and hides it). Reduce-scatter with "
                      "op=dist.ReduceOp.AVG, which divides the sum once"):
            reduce(shard_major / world, dist.ReduceOp.SUM),
        lambda k, e: (f"It is {world}× fully_shard's: the reduce-scatter summed; use "
                      "op=dist.ReduceOp.AVG"): reduce(shard_major, dist.ReduceOp.SUM),
        lambda k, e: ("It is this rank's own gradient, never reduced: reduce-scatter the "
                      "message and return your row's pieces"):
            [shard(g, rank, world) for g in grads],
        lambda k, e: ("The reduce-scatter is right, but the row was cut back without the "
                      "padding: each gradient takes ceil(d0/N) rows of the row (padding "
                      "included), so the next one starts after them, not after your real rows"):
            unpadded_cut(correct_row, shapes, rank, world),
    }, exact


def unpadded_cut(row: torch.Tensor, shapes, rank: int, world: int) -> list[torch.Tensor]:
    out, at = [], 0
    for s in shapes:
        owned = len(shard_rows(s[0], rank, world))
        n = owned * math.prod(s[1:])
        out.append(row[at:at + n].view(owned, *s[1:]))
        at += n
    return out


# ---------------------------------------------------------------- 11.4 the memory ledger
KINDS = ("params", "grads", "optimizer_state")
STAGES = {0: "native DDP", 1: "DDP + ZeroRedundancyOptimizer", 3: "fully_shard"}


def measured_bytes(rank: int) -> dict[int, dict[str, int]]:
    """One AdamW step under each stage, gradients left in place; every storage counted once."""
    found = {}
    ddp = NativeDDP(make_model())
    opt = torch.optim.AdamW(ddp.parameters(), **ADAMW)
    found[0] = one_step(ddp, list(ddp.parameters()), opt, opt, rank)
    ddp = NativeDDP(make_model())
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, **ADAMW)
    found[1] = one_step(ddp, list(ddp.parameters()), zero, zero.optim, rank)
    model = fully_sharded(make_model())
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    found[3] = one_step(model, list(model.parameters()), opt, opt, rank)
    return found


def one_step(model, params, stepper, holder, rank: int) -> dict[str, int]:
    x, y = batch(rank, 0)
    loss_of(model, x, y).backward()
    stepper.step()
    ledger = measure(params, holder)
    return {kind: int(getattr(ledger, kind)) for kind in KINDS}


def check_ledger(ctx: Context) -> None:
    shapes = [tuple(p.shape) for p in make_model().parameters()]
    measured = measured_bytes(ctx.rank)
    for stage, want in measured.items():
        got = ctx.call(ctx.learner.rank_bytes, list(shapes), ctx.world_size, ctx.rank, stage)
        where = f"rank_bytes(stage={stage}, {STAGES[stage]}) on rank {ctx.rank}"
        if not isinstance(got, dict) or set(KINDS) - set(got):
            raise Mistake(f"{where} returned {got!r}: return a dict with the keys "
                          f"{', '.join(KINDS)} (bytes)")
        for kind in KINDS:
            if got[kind] != want[kind]:
                cause = ledger_cause(shapes, ctx, stage, kind, got[kind], want[kind])
                raise Mistake(f"{where}: you predict {kind} = {got[kind]} bytes, measured "
                              f"{want[kind]}. {cause}".rstrip())


def ledger_cause(shapes, ctx, stage: int, kind: str, got, want: int) -> str:
    world, rank = ctx.world_size, ctx.rank
    numel = sum(math.prod(s) for s in shapes)
    real = padded = 0
    for s in shapes:
        c, inner = -(-s[0] // world), math.prod(s[1:])
        padded += c * inner
        real += max(0, min(c, s[0] - rank * c)) * inner
    per_element = 8 if kind == "optimizer_state" else 4
    if got == per_element * numel / world or got == per_element * numel // world:
        return (f"That is Ψ/{world}, the paper's even split: a real layout is not even "
                + ("(whole parameters have an owner: use the owners of exercise 11.1)"
                   if stage == 1 else "(dim-0 chunks of ceil(d0/N) rows, padded)"))
    if stage == 3 and got == per_element * real:
        return ("That counts the rows this rank really has: FSDP2 stores every shard padded to "
                "ceil(d0/N) rows (the last ranks' zero rows are memory too)")
    if stage == 3 and got == per_element * padded:
        return ("That counts the padding rows: AdamW makes its state like the parameter's local "
                "shard (torch.zeros_like of the unpadded DTensor shard), the real rows only")
    if got * 4 == want or got * 8 == want:
        return ("That is a count of elements: give bytes (float32 is 4 bytes per element, and "
                "AdamW keeps 2 tensors like the parameter)")
    return ""


EXERCISES = [
    Exercise("11.1", "owners", check_owners, world_sizes=(3,), timeout_s=30.0),
    Exercise("11.2", "ShardedOptimizer", check_zero1, world_sizes=(3,), timeout_s=60.0,
             hang_hint="Does every rank call dist.broadcast for every parameter, in the same "
                       "order?"),
    Exercise("11.3", "reduce_scatter_gradients", check_reduce_scatter, world_sizes=(3,),
             timeout_s=60.0, hang_hint="Does every rank call the reduce-scatter once per unit?"),
    Exercise("11.4", "rank_bytes", check_ledger, world_sizes=(3,), timeout_s=60.0),
]
