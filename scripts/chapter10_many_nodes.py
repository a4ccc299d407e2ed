"""Chapter 10 — many machines: two emulated nodes over a rate-limited link, a model to 1024 GPUs.

As root (with iproute2), builds two "machines" on this box: two Linux network namespaces joined
by a virtual cable, capped with ``tc ... tbf`` at 100 Mbit/s and 1 Gbit/s, and left unshaped.
Each namespace runs ``torchrun --nnodes 2 --nproc-per-node 2`` with c10d rendezvous to the other.
It measures all-reduce bus bandwidth inside a node and across the link, and DDP step time with
1 node x 2 ranks against 2 nodes x 2 ranks; then fits the cost model (ddplab.costmodel) to
chapters 03 and 05, checks it against the two-node measurements and projects it to 1024 GPUs.
Without root: says so in one line and runs the parts that need none (one node, loopback).

Run it:
    sudo python scripts/chapter10_many_nodes.py            # two emulated nodes + the model
    python scripts/chapter10_many_nodes.py --quick         # short runs, under a minute
    python scripts/chapter10_many_nodes.py --gpus 256 --link ib-ndr   # ask about your cluster
    python scripts/chapter10_many_nodes.py --replot        # redraw the figures from results.json
    make run-chapter10

Writes out/chapter10/{links.png, projection.png, results.json} (or under --out DIR).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddplab
import drawing.chapter10
from backstage import chapter10_report as report
from backstage import chapter10_verdicts
from backstage.chapter10_report import NodeFailed, node_failure, node_failure_from, wait_until
from ddplab import costmodel
from ddplab.run import netns, stopping, timing
from ddplab.run.chapter_main import run_chapter, the_folder
from ddplab.run.models import ResidualMLP

CHAPTER = 10
MiB = 1 << 20
RATES = {"unshaped": None, "1gbit": 1000.0, "100mbit": 100.0}  # Mbit/s per direction
BUCKET_CAP_MB = 4.0  # chapter 05's setting: three buckets for the book's 8 MiB of gradients
RDZV_PORT = 29510  # free by construction: the namespaces are new
KEEP_ALIVE_S, KEEP_ALIVE_ATTEMPTS = 2, 3  # heartbeats a silent node misses before it is dropped


# --- what every rank measures (in one node, or in two) ---------------------------------------

def wait_for_link(ctx: ddplab.RankContext, phase_dir: str | None, phase: str,
                  timeout: float) -> None:
    """Rank 0 tells the script it is ready for ``phase`` and waits until the link is set."""
    if phase_dir and ctx.is_main:
        Path(phase_dir, f"ready-{phase}").touch()
        deadline = time.monotonic() + timeout
        while not Path(phase_dir, f"go-{phase}").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the link for phase {phase!r} was never set")
            time.sleep(0.05)
    dist.barrier()


def busbw_gbps(size: int, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth: what each rank's link carried, in GB/s."""
    return size / seconds * 2 * (world - 1) / world / 1e9


def time_allreduce(size: int, rounds: int, group=None) -> float:
    x = torch.ones(size // 4)
    samples = timing.time_steps(lambda: dist.all_reduce(x, group=group), steps=rounds, warmup=1)
    return timing.slowest_rank(timing.median(samples)) * 1e-3  # seconds


# --8<-- [start:ddp_step]
def ddp_step_times(ctx: ddplab.RankContext, batch: int, steps: int) -> dict:
    """Median step (ms) of native DDP, and of the same step with no communication (no_sync)."""
    model = DDP(ResidualMLP(), bucket_cap_mb=BUCKET_CAP_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))

    def step(sync: bool) -> None:
        opt.zero_grad()
        if sync:
            torch.nn.functional.cross_entropy(model(x), y).backward()  # all-reduces buckets
        else:
            with model.no_sync():  # the same compute, gradients kept local
                torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    samples = timing.compare({"ddp": lambda: step(True), "compute": lambda: step(False)},
                             rounds=steps, warmup=1)  # interleaved: both see the same load
    ms = {name: timing.slowest_rank(timing.median(s)) for name, s in samples.items()}
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"step_ms": ms["ddp"], "compute_ms": ms["compute"],
            "exposed_ms": max(0.0, ms["ddp"] - ms["compute"]), "grad_bytes": grad_bytes}
# --8<-- [end:ddp_step]


def worker(ctx: ddplab.RankContext, args) -> dict | None:
    sizes = [256 * 1024, 4 * MiB] if ctx.quick else [256 * 1024, 1 * MiB, 4 * MiB, 16 * MiB]
    rounds, steps, batch = (3, 3, 64) if ctx.quick else (6, 8, 128)
    per_node = int(ctx.world_size / max(1, args.nodes))
    node_groups = [dist.new_group(list(range(n * per_node, (n + 1) * per_node)))
                   for n in range(args.nodes)]  # every rank creates every group
    mine = node_groups[ctx.rank // per_node]
    result = {"world_size": ctx.world_size, "nodes": args.nodes, "phases": {},
              "provenance": ddplab.run.results.provenance(ctx)}
    intra = time_allreduce(sizes[-1], rounds, group=mine)
    result["intra_node_busbw_gbps"] = busbw_gbps(sizes[-1], intra, per_node)
    for phase in args.phases.split(","):
        wait_for_link(ctx, args.phase_dir, phase, args.timeout)
        times = {s: time_allreduce(s, rounds) for s in sizes}
        result["phases"][phase] = {
            "allreduce_s": {str(s): t for s, t in times.items()},
            "busbw_gbps": busbw_gbps(sizes[-1], times[sizes[-1]], ctx.world_size),
            **ddp_step_times(ctx, batch, steps)}
    if ctx.is_main and args.node_result:
        Path(args.node_result).write_text(json.dumps(result))
    return result if ctx.is_main else None


# --- two emulated nodes ------------------------------------------------------------------------

# --8<-- [start:torchrun]
def torchrun_on(node: netns.Node, host: netns.Node, tag: str, program: list[str],
                timeout: float, max_restarts: int = 0) -> list[str]:
    """The command a real cluster runs on every node, here run inside one namespace."""
    return node.command([
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host.address}:{RDZV_PORT}",
        "--rdzv-id", tag, "--local-addr", node.address,
        # is_host: which node hosts the rendezvous store (torchrun's guess from the hostname
        # fails here: both namespaces share one hostname).
        "--rdzv-conf", f"is_host={int(node is host)},join_timeout={int(timeout)},"
                       f"last_call_timeout=1,read_timeout={int(timeout)},keep_alive_interval="
                       f"{KEEP_ALIVE_S},keep_alive_max_attempt={KEEP_ALIVE_ATTEMPTS}",
        "--max-restarts", str(max_restarts),
        *program])  # the script and its flags
# --8<-- [end:torchrun]


def run_two_nodes(args, phases: list[str], scratch: Path) -> dict:
    """Both nodes, every phase; the link rate is changed between phases, from here."""
    deadline = time.monotonic() + args.node_budget
    with netns.TwoNodes.create() as pair, contextlib.ExitStack() as files:
        a = pair.nodes[0]
        result_file = scratch / "nodes.json"
        worker_args = ["--node-worker", "--nodes", "2", "--phases", ",".join(phases),
                       "--phase-dir", str(scratch), "--node-result", str(result_file),
                       "--timeout", str(args.timeout), *(["--quick"] if args.quick else [])]
        logs = [files.enter_context(open(scratch / f"node-{n.namespace[-1]}.log", "w"))
                for n in pair.nodes]
        procs = []
        for node, log in zip(pair.nodes, logs, strict=True):
            env = {"GLOO_SOCKET_IFNAME": node.interface, "OMP_NUM_THREADS": "1",
                   "PYTHONUNBUFFERED": "1", "TMPDIR": report.node_tmpdir(scratch, node),
                   "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
            procs.append(subprocess.Popen(
                torchrun_on(node, a, pair.tag, [str(Path(__file__).resolve()), *worker_args],
                            args.timeout),
                stdout=log, stderr=subprocess.STDOUT, env=env))
        pending, training_since = list(phases), None
        while [p.poll() for p in procs].count(None):
            if (args.kill_node_after is not None and training_since is not None
                    and time.monotonic() - training_since > args.kill_node_after):
                pair.kill(pair.nodes[1])  # node b "loses power": every process in it dies
                args.kill_node_after = None
            if time.monotonic() > deadline:
                raise NodeFailed(f"the two-node run took over {args.node_budget:g} s; stopped "
                                 "(a busy machine? try --quick or a larger --node-budget)")
            if pending and (scratch / f"ready-{pending[0]}").exists():
                pair.set_rate(RATES[pending[0]])
                (scratch / f"go-{pending.pop(0)}").touch()
                training_since = training_since or time.monotonic()
            time.sleep(0.05)
        if not result_file.exists():
            raise node_failure(scratch, procs)
        return json.loads(result_file.read_text())


# --- a node dies, the job resumes -------------------------------------------------------------

CHAPTER07 = Path(__file__).resolve().with_name("chapter07_checkpointing.py")
FAILOVER_MBIT = 100.0  # slow enough that the kill lands between two checkpoints
POWER_CUT_TIMEOUT_S = 15.0  # collective timeout in the failovers (the rendezvous keeps --timeout)


def train_command(ckpt: Path, args, timeout: float) -> list[str]:
    """Chapter 07's checkpointed training (--quick), resuming from ``ckpt`` if it has one."""
    return [str(CHAPTER07), "--train", "--quick", "--ckpt-dir", str(ckpt), "--seed",
            str(args.seed), "--timeout", str(timeout), "--out", str(ckpt / "out")]


def reference_run(args, scratch: Path) -> Path:
    """The same training on 4 ranks, never interrupted: what a resumed run must equal."""
    reference = scratch / "reference"
    tmp = scratch / "tmp-reference"  # its temporary files go with the run, whatever happens
    tmp.mkdir()
    code, out = stopping.run_to_end(
        [sys.executable, *train_command(reference, args, args.timeout), "--world-size", "4"],
        env={**os.environ, "TMPDIR": str(tmp)}, timeout=args.node_budget)
    if code != 0:
        last = out.strip().splitlines()[-1:] or ["no output"]
        raise NodeFailed(f"failover: the reference run failed (exit {code}): {last[0][:300]}")
    return reference


# --8<-- [start:failover]
def failover(args, scratch: Path, reference: Path, power_cut: bool) -> dict:
    """Lose node b after the first checkpoint; relaunch it, as a scheduler would."""
    deadline, how = time.monotonic() + args.node_budget, "power_cut" if power_cut else "kill"
    ckpt, timeout = scratch / how, min(args.timeout, POWER_CUT_TIMEOUT_S)
    with netns.TwoNodes.create() as pair, contextlib.ExitStack() as files:
        pair.set_rate(FAILOVER_MBIT)
        a, b = pair.nodes

        def start(node: netns.Node, log: str) -> subprocess.Popen:
            cmd = torchrun_on(node, a, pair.tag, train_command(ckpt, args, timeout),
                              args.timeout, max_restarts=1)
            out = files.enter_context(open(scratch / f"{how}-{log}.log", "w"))
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    env=report.failover_env(scratch, node))
        node_a, _ = start(a, "a"), start(b, "b")
        wait_until(lambda: any(ckpt.rglob("step_*")), deadline, "a first checkpoint")
        before = set(pair.pids(a))
        (pair.cut_power if power_cut else pair.kill)(b)  # every process of node b
        lost_at = time.monotonic()
        wait_until(lambda: len(before - set(pair.pids(a))) >= 2, deadline, "a's ranks' end")
        detected_s = time.monotonic() - lost_at
        wait_until(lambda: not pair.pids(b), deadline, "node b's death")
        if power_cut:
            pair.restore_power(b)
        start(b, "b2")  # the scheduler brings a node back
        wait_until(lambda: len(set(pair.pids(a)) - before) >= 2, deadline, "a's new ranks")
        restarted_s = time.monotonic() - lost_at
        wait_until(lambda: node_a.poll() is not None, deadline, "the resumed run's end")
        if node_a.returncode != 0:
            raise node_failure_from(scratch / f"{how}-a.log", f"failover ({how})")
    # --8<-- [end:failover]
    final = torch.load(ckpt / "final.pt", weights_only=True)
    ref = torch.load(reference / "final.pt", weights_only=True)
    return {"resumed_from_step": final["resumed_from"], "attempt": final["attempt"],
            "max_abs_diff": (final["params"] - ref["params"]).abs().max().item(),
            "detected_s": detected_s, "recovery_s": time.monotonic() - lost_at,
            "restarted_s": restarted_s, "keep_alive_s": KEEP_ALIVE_S * KEEP_ALIVE_ATTEMPTS,
            "node_a_heard": report.how_node_a_heard(scratch / f"{how}-a.log"),
            "collective_timeout_s": timeout, "link_mbit": FAILOVER_MBIT}


def one_node(args, phase: str) -> ddplab.Run:
    """One node x 2 ranks over loopback, spawned: a fork server's folder outlives a SIGKILL."""
    args.nodes, args.phases, args.phase_dir, args.node_result = 1, phase, None, None
    args.world_size = 2
    return ddplab.launch(worker, args, start_method="spawn")


# --- the model: calibrated, checked against the link, projected -------------------------------

def calibration(out: Path) -> dict:
    """α, β, γ from chapter 03, compute from chapter 05: the reader's runs, else the committed;
    with where and when each was measured, which the page shows beside the values."""
    for root in (out, ddplab.run.results.REPO_ROOT / "figures"):
        fit = costmodel.chapter03_fit(root)  # None for a --quick run: no bandwidth in it
        try:
            ch05 = ddplab.read_results(root, 5)
            compute = float(ch05["step_time_ms"]["local"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # missing, or keys of another shape
        if fit is not None:
            run = costmodel.run_label(root)
            return {"alpha_us": fit["alpha_us"], "beta_gbps": fit["beta_gbps"],
                    "gamma_s_per_byte": fit["gamma_s_per_byte"], "compute_ms": compute,
                    "run": run,
                    "source": f"chapters 03 and 05, {run} ({costmodel.shown_path(root)})",
                    "chapter03": {"measured": fit["measured"], "device": fit["device"],
                                  "source": fit["source"]},
                    "chapter05": {"measured": ch05.get("provenance", {}).get("date"),
                                  "device": ch05.get("provenance", {}).get("device")}}
    raise ddplab.UsageError(
        "the cost model needs chapter 03's alpha-beta fit (a full run, not --quick) and "
        f"chapter 05's step time, and found neither in {out} nor in the committed figures/: "
        "run `make run-chapter03 run-chapter05` first (or `git checkout figures/`)")


# --8<-- [start:predict_link]
def predict_emulated(compute_ms: float, grad_bytes: int, world: int, rate_mbit: float | None,
                     cal: dict) -> float:
    """Predicted DDP step (ms) on the emulated nodes: a ring whose slowest hop is the cable
    (each direction capped at ``rate_mbit``) or, unshaped, gloo over loopback (chapter 03's β)."""
    link = cal["beta_gbps"] * 1e9
    if rate_mbit is not None:
        link = min(link, rate_mbit * 1e6 / 8)
    def allreduce(size: float) -> float:
        return costmodel.ring_time(size, world, cal["alpha_us"] * 1e-6, link,
                                   cal.get("gamma_s_per_byte", 0.0))
    buckets = costmodel.bucket_sizes(grad_bytes, BUCKET_CAP_MB * MiB)
    return costmodel.step_time(compute_ms * 1e-3, buckets, allreduce)["step_s"] * 1e3
# --8<-- [end:predict_link]


def predict_from_own_allreduce(m: dict, world: int) -> float:
    """The step model alone: all-reduce cost as measured in the same run, compute as measured."""
    buckets = costmodel.bucket_sizes(m["grad_bytes"], BUCKET_CAP_MB * MiB)
    step = costmodel.step_time(m["compute_ms"] * 1e-3, buckets,
                               costmodel.fitted_allreduce(m["allreduce_s"], world))
    return step["step_s"] * 1e3


def validate(one: dict, two: dict | None, cal: dict) -> dict:
    runs = {"1x2_loopback": (one["phases"]["loopback"], 2, None)}
    for phase, measured in (two or {}).get("phases", {}).items():
        runs[f"2x2_{phase}"] = (measured, 4, RATES[phase])
    rows = {}
    for name, (m, world, rate) in runs.items():
        predicted = predict_emulated(m["compute_ms"], m["grad_bytes"], world, rate, cal)
        own = predict_from_own_allreduce(m, world)
        rows[name] = {"measured_ms": m["step_ms"], "compute_ms": m["compute_ms"],
                      "exposed_ms": m["exposed_ms"], "predicted_ms": predicted,
                      "exposed_share": m["exposed_ms"] / m["step_ms"],
                      "predicted_own_allreduce_ms": own,
                      "rel_error_own_allreduce": abs(own - m["step_ms"]) / m["step_ms"],
                      "rel_error": abs(predicted - m["step_ms"]) / m["step_ms"]}
    errors = {name: r["rel_error"] for name, r in rows.items()}
    shaped = [e for name, e in errors.items() if name.endswith("bit")]
    return {"runs": rows, "max_rel_error": max(errors.values()),
            "within_15_percent": max(errors.values()) <= 0.15,
            "max_rel_error_shaped": max(shaped) if shaped else None,
            "max_rel_error_own_allreduce": max(r["rel_error_own_allreduce"]
                                               for r in rows.values())}


MODELS = {  # name: (gradient bytes or buckets, compute s per step on one GPU, how it was set)
    "book": None,  # filled from chapter 05's measured compute
    "1B": (costmodel.transformer_gradient_buckets(1e9), costmodel.transformer_compute_s(
        1e9, 16384), "6·P·tokens at 40 % MFU"),
    "7B": (costmodel.transformer_gradient_buckets(7e9), costmodel.transformer_compute_s(
        7e9, 16384), "6·P·tokens at 40 % MFU"),
}
GPUS = [2 ** k for k in range(1, 11)]  # 2 … 1024


def project(cal: dict, book_grad_bytes: int, links=("ib-ndr", "eth-100g"),
            algo: str = "ring") -> dict:
    models = dict(MODELS, book=(book_grad_bytes, cal["compute_ms"] * 1e-3,
                                "chapter 05's measured step, as if each GPU were that fast"))
    out = {}
    for link in links:
        for name, (grad, compute, how) in models.items():
            eff = [costmodel.cluster_step(compute, grad, n, link=link, algo=algo)["efficiency"]
                   for n in GPUS]
            out[f"{name}_{link}"] = {"gpus": GPUS, "efficiency": eff, "compute_s": compute,
                                     "grad_bytes": sum(grad) if isinstance(grad, list) else grad,
                                     "buckets": len(grad) if isinstance(grad, list) else None,
                                     "compute_from": how,
                                     "at": {str(n): e for n, e in zip(GPUS, eff, strict=True)}}
    return out


# --- the reader's question, and main ------------------------------------------------------

def ask(args, cal: dict, grad_bytes: int) -> dict:
    """The reader's question: this many GPUs on this link."""
    rows = {}
    for name, (grad, compute, _) in dict(
            MODELS, book=(grad_bytes, cal["compute_ms"] * 1e-3, "")).items():
        r = costmodel.cluster_step(compute, grad, args.gpus, link=args.link,
                                   per_node=args.per_node, algo=args.algo)
        rows[name] = r
        print(f"{name:>4} on {args.gpus} GPUs, {args.link}, {args.algo}: step "
              f"{r['step_s'] * 1e3:.1f} ms, exposed {r['exposed_s'] * 1e3:.1f} ms, "
              f"efficiency {r['efficiency']:.2f}")
    return rows


def parse_args(argv: list[str] | None = None):
    parser = ddplab.chapter_parser(__doc__, prog="chapter10_many_nodes.py")
    parser.add_argument("--gpus", type=ddplab.positive(int), default=None,
                        help="also predict a step on this many GPUs")
    parser.add_argument("--link", choices=sorted(costmodel.LINKS), default="ib-ndr",
                        help="the link between nodes, for --gpus (default: ib-ndr)")
    parser.add_argument("--per-node", type=ddplab.positive(int), default=8,
                        help="GPUs per node, for --gpus (default: 8)")
    parser.add_argument("--algo", choices=("ring", "tree"), default="ring",
                        help="all-reduce across nodes, for --gpus (default: ring)")
    parser.add_argument("--node-budget", type=ddplab.positive(float), default=300.0,
                        help="seconds the two-node run may take in all (default: 300)")
    parser.add_argument("--failover", action=argparse.BooleanOptionalAction, default=None,
                        help="kill a node mid-training and resume (default: on, off with --quick)")
    report.add_node_flags(parser)  # hidden: what the ranks started on each node are told
    return ddplab.parse_chapter_args(parser, argv)


def measure(args) -> ddplab.Run | None:
    """One node over loopback, then (as root) two emulated nodes: what rank 0 of each measured,
    with the loopback run's provenance.  None in one rank of the two-node run."""
    if args.node_worker:  # one rank of the two-node run, started by torchrun
        ddplab.launch(worker, args)
        return None
    cal = calibration(args.out)  # before the runs: a missing calibration is a one-line error
    one = one_node(args, "loopback")
    two, reason = None, netns.unavailable_reason()
    if reason:
        print(f"note: two emulated nodes skipped: {reason}; ran one node over loopback only")
    else:
        removed = netns.remove_leftovers(tempfile.gettempdir())
        if removed:
            print(f"note: {netns.leftovers_line(removed)}")
        with tempfile.TemporaryDirectory(prefix=netns.scratch_dir_prefix("ch10")) as scratch:
            if losing := args.failover or (args.failover is None and not args.quick):
                reference = reference_run(args, Path(scratch))  # first: it needs no node
            two = run_two_nodes(args, list(RATES), Path(scratch))
            if losing:
                two["failover"] = failover(args, Path(scratch), reference, power_cut=False)
                two["power_cut"] = failover(args, Path(scratch), reference, power_cut=True)
    return ddplab.Run({"calibration": cal, "one_node": one.result, "two_node": two,
                       "skipped_reason": reason}, one.provenance)


def finish(args, run: ddplab.Run) -> dict:
    """results.json: the runs, the model checked against them and projected to 1024 GPUs."""
    cal, one, two = run.result["calibration"], run.result["one_node"], run.result["two_node"]
    grad_bytes = one["phases"]["loopback"]["grad_bytes"]
    metrics = {"two_nodes": two is not None, "skipped_reason": run.result["skipped_reason"],
               "one_node": one, "two_node": two, "calibration": cal,
               "validation": validate(one, two, cal),
               "projection": project(cal, grad_bytes), "links": {
                   k: vars(v) for k, v in costmodel.LINKS.items()}}
    metrics["verdicts"] = chapter10_verdicts.verdicts(metrics, RATES, BUCKET_CAP_MB * MiB)
    if args.gpus:
        metrics["query"] = ask(args, cal, grad_bytes)
    return metrics


def main(argv: list[str] | None = None) -> dict | None:
    return run_chapter(CHAPTER, parse_args(argv), start=measure, finish=finish,
                       draw=drawing.chapter10.draw,
                       summarize=lambda metrics, run: report.summarize(metrics),
                       wrote=the_folder)


if __name__ == "__main__":
    sys.exit(ddplab.run_main(main))
