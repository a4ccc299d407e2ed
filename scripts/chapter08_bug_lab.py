"""Chapter 08 — the bug lab: real DDP failures, reproduced, diagnosed with the real tools, fixed.

Every scenario is a small broken function and its fixed twin (scripts/ddplab/bugs/).  The lab
runs each one broken, then fixed, and writes down what the reader would see: the first lines of
the error as this torch prints it (or, for a silent bug, the number that gives it away), how long
it took to surface, what reveals it, and whether the fix ran clean.  Hangs end after a short
process-group timeout.  The full run also re-runs bugs under the diagnosis tools
(TORCH_DISTRIBUTED_DEBUG, the flight recorder and torchfrtrace, py-spy, TORCH_CPP_LOG_LEVEL).

Run it:
    python scripts/chapter08_bug_lab.py --list                  # the scenarios, one per line
    python scripts/chapter08_bug_lab.py --bug unused_parameter  # one bug, as you would meet it
    python scripts/chapter08_bug_lab.py --bug unused_parameter --fixed
    python scripts/chapter08_bug_lab.py                         # the whole lab (+ diagnoses)
    python scripts/chapter08_bug_lab.py --quick                 # the whole lab, no diagnoses
    torchrun --standalone --nproc-per-node 2 scripts/chapter08_bug_lab.py --quick  # crash skipped
    python scripts/chapter08_bug_lab.py --replot                # no figures: says so, exit 0

Writes out/chapter08/results.json and one fix_<scenario>.diff per scenario (the fix, as a
diff of the two functions) — only for the whole lab, never for a single --bug.
"""

from __future__ import annotations

import difflib
import inspect
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

import ddplab
from ddplab.bugs import diagnose
from ddplab.bugs.catalog import BY_NAME, GPU_ONLY, SCENARIOS, Scenario
from ddplab.bugs.runner import HANG_TIMEOUT_S, gather_outcome, judge, run_in_main, run_on_this_rank
from ddplab.run.cli import with_changes
from ddplab.run.launch import started_by_torchrun

CHAPTER = 8
DIAGNOSIS_TIMEOUT_S = 3.0  # the hang under the flight recorder: the launch's own timeout


# --- inside the ranks ------------------------------------------------------------------------

def shared_scratch(ctx) -> Path:
    """A directory every rank can write to, under torchrun: rank 0 makes it and tells the
    others (with mp.spawn the launching process makes it: run_plan)."""
    holder = [tempfile.mkdtemp(prefix="buglab-") if ctx.is_main else None]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def worker(ctx: ddplab.RankContext, args) -> list[dict] | None:
    """Run the plan's scenarios one after the other, every error caught, every hang timed out."""
    scratch = args.scratch or shared_scratch(ctx)
    outcomes = []
    try:
        for name, fixed in args.plan:
            sc = BY_NAME[name]
            mine = run_on_this_rank(sc, fixed, ctx, scratch)
            outcomes.append(gather_outcome(sc, fixed, mine))
            dist.barrier()  # the default group is untouched by the hangs: still in step
    finally:
        dist.barrier()
        if ctx.is_main and not args.scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return outcomes if ctx.is_main else None


def crash_worker(ctx: ddplab.RankContext, args) -> None:
    """rank_crash, broken, for real: the failing rank's process ends, as it would in training."""
    mine = run_on_this_rank(BY_NAME["rank_crash"], False, ctx, args.scratch)
    (args.scratch / f"rank{ctx.rank}.json").write_text(json.dumps(mine))
    if mine["error"]:
        raise RuntimeError(mine["error"][0])


# --- in the launching process ----------------------------------------------------------------

def run_plan(args, plan: list[tuple[str, bool]]) -> list[dict]:
    if not plan:
        return []
    if started_by_torchrun():  # the ranks are all there is: rank 0 makes the scratch
        run = ddplab.launch(worker, with_changes(args, plan=plan, scratch=None))
        return [] if run is None else run.result
    # Made and removed here, not in a rank: a rank stopped by Ctrl-C or SIGTERM runs no
    # cleanup, this process does.
    with tempfile.TemporaryDirectory(prefix="buglab-") as scratch:
        return ddplab.launch(worker, with_changes(args, plan=plan, scratch=Path(scratch))).result


def run_crash(args) -> dict:
    """Its own launch: one rank really fails, and the launcher stops the others."""
    sc = BY_NAME["rank_crash"]
    with tempfile.TemporaryDirectory(prefix="buglab-crash-") as scratch:
        job = with_changes(args, scratch=Path(scratch))
        start = time.perf_counter()
        try:
            ddplab.launch(crash_worker, job)
            root_cause = None
        except ddplab.RankFailed as err:
            root_cause = str(err)
        seconds = time.perf_counter() - start
        reports = [json.loads(p.read_text()) for p in sorted(Path(scratch).glob("rank*.json"))]
    record = judge(sc, False, reports or [{"rank": 0, "error": [root_cause or "no report"],
                                           "value": None, "seconds": seconds, "warnings": []}])
    record.update(root_cause=root_cause, seconds_including_startup=seconds)
    return record


def run_diagnoses(args) -> dict:
    """The full lab's second look: each bug under the tool that finds it."""
    found: dict = {}
    with tempfile.TemporaryDirectory(prefix="buglab-diag-") as scratch:
        job = with_changes(args, scratch=Path(scratch))
        with diagnose.environment(TORCH_DISTRIBUTED_DEBUG="INFO"):
            found.update(ddplab.launch(diagnose.info_worker, job).result)
        with diagnose.environment(TORCH_DISTRIBUTED_DEBUG="DETAIL"):
            found.update(ddplab.launch(diagnose.detail_worker, job).result)
            try:
                found["detail_with_ddp"] = ddplab.launch(diagnose.detail_ddp_worker, job).result
            except ddplab.RankFailed as err:  # what we saw on torch 2.13 + gloo: a crash
                found["detail_with_ddp"] = str(err)
        hang_job = with_changes(job, timeout=DIAGNOSIS_TIMEOUT_S)
        with diagnose.environment(TORCH_FR_BUFFER_SIZE="64"):
            hang = ddplab.launch(diagnose.hang_worker, hang_job).result
        hang["flight_recorder"] = diagnose.analyse_flight_record(Path(scratch))
        found["one_rank_collective"] = hang
    found["port_taken"] = diagnose.port_log()
    return found


def plan_for(args) -> tuple[list[Scenario], list[tuple[str, bool]]]:
    chosen = [BY_NAME[args.bug]] if args.bug else SCENARIOS
    versions = [args.fixed] if args.bug else [False, True]
    in_ranks = [(sc.name, fixed) for sc in chosen for fixed in versions
                if sc.where == "ranks" or (sc.where == "own" and fixed)]
    return chosen, in_ranks


def run_lab(args) -> dict[str, dict] | None:
    """Every chosen scenario, in the fewest launches: {name: {"broken": ..., "fixed": ...}}."""
    chosen, in_ranks = plan_for(args)
    versions = [args.fixed] if args.bug else [False, True]
    records: dict[str, dict] = {sc.name: {} for sc in chosen}
    for sc in chosen:  # before any process group exists
        if sc.where == "main":
            for fixed in versions:
                records[sc.name][_version(fixed)] = run_in_main(sc, fixed)
    outcomes = run_plan(args, in_ranks)
    if started_by_torchrun() and not outcomes:
        return None  # a rank other than 0 under torchrun: rank 0 reports
    for record in outcomes:
        records[record["scenario"]][record["version"]] = record
    if "rank_crash" in records and False in versions:
        records["rank_crash"]["broken"] = (
            run_crash(args) if not started_by_torchrun() else
            {"skipped": "under torchrun the processes are the ranks: run it with python"})
    return records


def _version(fixed: bool) -> str:
    return "fixed" if fixed else "broken"


# --- the fix, as a diff of the two functions --------------------------------------------------

def fix_diff(sc: Scenario) -> str:
    """The broken function against the fixed one, both named after the scenario."""
    def source(fn, suffix: str) -> list[str]:
        text = inspect.getsource(fn).replace(f"def {sc.name}_{suffix}(", f"def {sc.name}(")
        return text.splitlines()
    lines = difflib.unified_diff(source(sc.broken(), "broken"), source(sc.fixed(), "fixed"),
                                 "broken", "fixed", n=50, lineterm="")
    return "\n".join(list(lines)[2:]) + "\n"  # without the ---/+++ header


# --- results ---------------------------------------------------------------------------------

def index_text(first_line: str | None) -> str:
    """The error's first sentence, for the page's symptom index (no backticks: inline code)."""
    if not first_line:
        return ""
    sentence = re.split(r"(?<=[a-z0-9)])\. ", first_line, maxsplit=1)[0]
    return sentence.replace("`", "'")


def scenario_result(sc: Scenario, versions: dict, diagnosis) -> dict:
    broken, fixed = versions["broken"], versions["fixed"]
    result = {"kind": sc.kind, "summary": sc.summary, "expect": sc.expect,
              "raised_by": sc.raised_by, "diagnosis": sc.diagnosis,
              "reproduced": bool(broken.get("symptom")), "fixed_clean": bool(fixed.get("clean")),
              "broken": broken, "fixed": fixed}
    if sc.kind == "silent":
        result["first_line"] = broken.get("giveaway_text")
        result["giveaway"] = broken.get("giveaway")
        result["giveaway_fixed"] = fixed.get("giveaway")
        result["giveaway_text_fixed"] = fixed.get("giveaway_text")
    else:
        result["first_line"] = broken.get("first_line")
        result["text"] = "\n".join(broken.get("lines", [])[:6])
    result["index_text"] = index_text(result["first_line"])
    result["seconds_to_symptom"] = broken.get("seconds")
    if diagnosis is not None:
        result["diagnosis_output"] = diagnosis
    return result


def summarize(results: dict) -> str:
    lines = [f"{'scenario':<22}{'kind':<8}{'surfaced':>9}  fixed  symptom (first line, cut)"]
    for name, r in results["scenarios"].items():
        if r["broken"].get("skipped"):
            lines.append(f"{name:<22}{r['kind']:<8}{'—':>9}  {'—':<5}  {r['broken']['skipped']}")
            continue
        fixed = "clean" if r["fixed_clean"] else "FAIL"
        seen = r["first_line"] or "(no symptom!)"
        lines.append(f"{name:<22}{r['kind']:<8}{r['seconds_to_symptom']:>8.2f}s  {fixed:<5}  "
                     f"{seen[:60]}")
    skipped = sum(bool(r["broken"].get("skipped")) for r in results["scenarios"].values())
    lines.append(f"{results['reproduced']} of {len(results['scenarios'])} bugs reproduced"
                 f"{f' ({skipped} skipped under torchrun)' if skipped else ''}, "
                 f"{results['fixed_clean']} fixes ran clean; "
                 f"{len(GPU_ONLY)} GPU-only bugs described, not reproduced on this machine")
    return "\n".join(lines)


def show_one(sc: Scenario, record: dict, fixed: bool) -> bool:
    """--bug NAME: what the reader would see, then a verdict.  True if it behaved as billed."""
    if record.get("skipped"):
        print(f"{sc.name}: {record['skipped']}")
        return True
    for rank, line in sorted(record["errors"].items()):
        if rank != str(record["rank_shown"]):
            print(f"[rank {rank}] {line}")
    if record["lines"]:
        print(f"[rank {record['rank_shown']}] " + "\n  ".join(record["lines"]))
    if record.get("root_cause"):
        print(f"the launcher's verdict: {record['root_cause']}")
    if record.get("giveaway_text"):
        print(f"giveaway: {record['giveaway_text']}")
    for warning in record["warnings"]:
        print(f"warning seen: {warning}")
    if fixed:
        print(f"{sc.name} (fixed): {'ran clean' if record['clean'] else 'did NOT run clean'}")
        return record["clean"]
    print(f"{sc.name} (broken, {sc.kind}): symptom after {record['seconds']:.2f} s — "
          f"{'reproduced' if record['symptom'] else 'NOT reproduced'}")
    return record["symptom"]


# --- command line ----------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None):
    parser = ddplab.chapter_parser(__doc__, prog="chapter08_bug_lab.py")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--bug", metavar="NAME", default=None,
                        help="run one scenario (see --list); writes no results.json")
    parser.add_argument("--fixed", action="store_true", help="with --bug: the fixed version")
    args = ddplab.parse_chapter_args(parser, argv)
    if args.bug is not None and args.bug not in BY_NAME:
        raise ddplab.UsageError(f"--bug {args.bug!r}: no such scenario; "
                                f"--list shows them ({', '.join(BY_NAME)})")
    if args.fixed and args.bug is None:
        raise ddplab.UsageError("--fixed needs --bug NAME (the whole lab runs both versions)")
    world = dist.get_world_size() if dist.is_initialized() else (args.world_size or 2)
    if not started_by_torchrun() and world != 2:
        raise ddplab.UsageError("the bug lab runs on 2 ranks (--world-size 2): its scenarios "
                                "are written for rank 0 and rank 1")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.replot:  # the same flag as every chapter's; this one has no figure to redraw
        print("chapter 08 draws no figures: nothing to redraw (it writes results.json and "
              "fix_*.diff)")
        return None
    if args.list:
        for sc in SCENARIOS:
            print(f"{sc.name:<22}{sc.kind:<8}{sc.summary}")
        for name, gpu in GPU_ONLY.items():
            print(f"{name:<22}{'gpu':<8}{gpu['summary']} (not reproduced on this machine)")
        return None
    start = time.perf_counter()
    provenance = _provenance(args)  # before the run: the commit the code ran at
    records = run_lab(args)
    if records is None:
        return None
    if args.bug:
        (version, record), = records[args.bug].items()
        if not show_one(BY_NAME[args.bug], record, args.fixed):
            raise ddplab.RankFailed(0, f"{args.bug} ({version}) did not behave as the lab "
                                       "expects: see the lines above")
        return record
    full = not args.quick and not started_by_torchrun()
    diagnoses = run_diagnoses(args) if full else {}
    scenarios = {sc.name: scenario_result(sc, records[sc.name], diagnoses.get(sc.name))
                 for sc in SCENARIOS}
    results = {"seconds": time.perf_counter() - start, "scenarios": scenarios,
               "scenario_count": len(scenarios),
               "reproduced": sum(r["reproduced"] for r in scenarios.values()),
               "fixed_clean": sum(r["fixed_clean"] for r in scenarios.values()),
               "diagnoses_run": full, "gpu_only": GPU_ONLY,
               "detail_with_ddp": diagnoses.get("detail_with_ddp", "not run (--quick)"),
               "hang_timeout_s": HANG_TIMEOUT_S}
    with ddplab.chapter_output(args.out, CHAPTER) as out:
        for sc in SCENARIOS:
            (out / f"fix_{sc.name}.diff").write_text(fix_diff(sc))
        ddplab.write_results(out, CHAPTER, results, provenance)
    print(summarize(results))
    print(f"wrote {args.out / f'chapter{CHAPTER:02d}'}/{{results.json, fix_*.diff}}")
    return results


def _provenance(args) -> dict:
    import torch

    from ddplab.run.ranks import RankContext
    from ddplab.run.results import provenance

    ctx = RankContext(rank=0, local_rank=0, world_size=2, backend="gloo",
                      device=torch.device("cpu"), seed=args.seed, quick=args.quick,
                      launcher="torchrun" if started_by_torchrun() else "mp.spawn")
    return provenance(ctx)


if __name__ == "__main__":
    sys.exit(ddplab.run_main(main))
