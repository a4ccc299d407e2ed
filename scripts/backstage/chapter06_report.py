"""Chapter 06's launching process: rank 0's measurements turned into results.json, and a summary.

* ``checked_args``: the chapter's own flags (--delays, --slow-rank) checked;
* ``summarize_sweep``: a straggler sweep's step times and idle times, and the fitted slopes;
* ``chapter_metrics``: results.json (what the page and scripts/drawing/chapter06.py read);
* ``summarize``: the results on one screen.
The measurements themselves stay in scripts/chapter06_bubbles.py.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict

from ddplab import stragglers
from ddplab.run.cli import UsageError
from ddplab.run.launch import planned_world_size


def checked_args(args, delays: dict):
    """The parsed flags, with --delays as numbers; refuse 1 rank and a --slow-rank outside it."""
    args.delays = parse_delays(args.delays, delays["quick" if args.quick else "full"],
                               args.timeout)
    world = planned_world_size(args)
    if world < 2 and not args.replot:
        raise UsageError("chapter 06 needs at least 2 ranks (--world-size 2): "
                         "a bubble is one rank waiting for another")
    if args.slow_rank is not None and not 0 <= args.slow_rank < world:
        raise UsageError(f"--slow-rank {args.slow_rank}: ranks are 0..{world - 1}")
    return args


def parse_delays(text: str | None, default: list[float], timeout_s: float) -> list[float]:
    """--delays: milliseconds separated by commas (``default`` when not given), each shorter
    than ``timeout_s`` (a longer one would end the run as hung, after the whole sweep)."""
    if text is None:
        return [float(d) for d in default]
    try:
        delays = [float(d) for d in text.split(",")]
    except ValueError:
        raise UsageError(f"--delays {text!r}: give milliseconds separated by commas, "
                                "e.g. 0,10,20,40") from None
    # NaN compares false with everything (min() passes it over): test each value itself.
    if len(delays) < 2 or not all(0 <= d < timeout_s * 1e3 for d in delays):
        raise UsageError(f"--delays {text!r}: need at least two delays, each a number of ms "
                         f"from 0 up to below --timeout ({timeout_s * 1e3:g} ms)")
    return delays


def summarize_sweep(sweep: dict, delays: list[float], slow_rank: int) -> dict:
    """Fast ranks' mean idle, the step time (as slow as the slowest rank), fitted slopes."""
    ranks = sweep["per_rank"]
    fast = [r for i, r in enumerate(ranks) if i != slow_rank]
    idle_fast = [statistics.fmean(r["idle_ms"][k] for r in fast) for k in range(len(delays))]
    step = [max(r["step_ms"][k] for r in ranks) for k in range(len(delays))]
    slope_idle, intercept_idle = stragglers.fit_line(delays, idle_fast)
    slope_step, intercept_step = stragglers.fit_line(delays, step)
    summary = {
        "delay_ms": delays, "step_time_ms": step, "idle_ms_fast_ranks": idle_fast,
        "idle_ms_slow_rank": ranks[slow_rank]["idle_ms"],
        "slope_idle": slope_idle, "intercept_idle_ms": intercept_idle,
        "slope_step_time": slope_step, "intercept_step_time_ms": intercept_step,
    }
    if any(any(r["wait_span_ms"]) for r in ranks):  # BucketedDDP times its own wait
        summary["wait_span_ms_fast_ranks"] = [
            statistics.fmean(r["wait_span_ms"][k] for r in fast) for k in range(len(delays))]
    return summary


def logging_verdict(metric: dict) -> dict:
    """How much slower the logged step was, and how much of that the logging call's own time
    covers.  The call is timed inside the logged steps, the steps' medians separately, and
    medians do not add: the split is rough, and where it cannot hold the text says so."""
    with_ms, without_ms = metric["step_time_ms"]["with"], metric["step_time_ms"]["without"]
    gap, call = with_ms - without_ms, metric["reduce_ms"]
    out = {"gap_ms": gap, "gap_share_of_step": gap / without_ms, "rest_ms": gap - call,
           "call_share_of_gap": call / gap if gap > 0 else None}
    if gap <= 0:
        out["text"] = (f"The steps with it were not slower here ({with_ms:.2f} against "
                       f"{without_ms:.2f} ms): the call's {call:.2f} ms vanished in the noise of "
                       "the steps")
    elif call >= gap:
        out["text"] = (f"The steps with it were {gap:.2f} ms slower, no more than the call itself "
                       "took: medians of noisy steps do not add, so this run does not split it")
    else:
        out["text"] = (f"The steps with it were {gap:.2f} ms ({gap / without_ms:.0%}) slower; "
                       f"the call itself covers about {call / gap:.0%} of that, and the other "
                       f"{gap - call:.2f} ms lie outside it, where this run times nothing "
                       "(medians do not add exactly, so the split is rough)")
    return out


def chapter_metrics(result: dict, hung: dict, delays: list[float], provenance: dict,
                    traces: list[str], expected_slope: float, bubble_delay_ms: float) -> dict:
    """results.json from rank 0's result, the two hang demonstrations and the trace files."""
    slow = result["slow_rank"]
    sweeps = {kind: summarize_sweep(s, delays, slow) for kind, s in result["sweeps"].items()}
    uneven = result["uneven"]
    join_completed = (len(uneven["batches_per_rank"]) == provenance["world_size"]
                      and uneven["join_max_abs_diff_params"] == 0.0)
    no_join = hung["uneven_without_join"]
    return {
        "straggler": {**sweeps["native"], "slow_rank": slow,
                      "expected_slope": expected_slope, "bucketed": sweeps["bucketed"],
                      "bubble_delay_ms": bubble_delay_ms},
        "syncbn": {k: v for k, v in result["syncbn"].items()},
        "sync_points": {"metric_reduction": {**result["metric"],
                                             "verdict": logging_verdict(result["metric"])},
                        "rank0_work": stragglers.rank0_work_numbers(result["rank0_work"]),
                        "rank0_only_collective": hung["rank0_only_collective"]},
        "hook": result["hook"],
        "uneven": {"join_completed": join_completed,
                   "without_join": no_join["what_happened"],
                   "without_join_demo": no_join,
                   "batches_per_rank": uneven["batches_per_rank"],
                   "join_max_abs_diff_params": uneven["join_max_abs_diff_params"],
                   "collectives_per_step": result["join_collectives"],
                   "throw_on_early_termination": uneven["throw_on_early_termination"],
                   "sampler": uneven["sampler"]},
        "timeline_source": ("torch.profiler (profiler_rank*.json) and ddplab.Timeline "
                            "(CUDA events)" if "profiler_traces" in result else
                            "ddplab.Timeline (host clock, perf_counter)"),
        "buckets_per_step": {kind: len({e.name for e in ev if e.cat == "comm"})
                             for kind, ev in result["timelines"].items()},
        "buckets_in_flight_at_last_launch": stragglers.buckets_in_flight(
            result["timelines"]["native"]),
        "trace_files": traces,
        "timelines": {name: [asdict(e) for e in events] for name, events in (
            *result["timelines"].items(), ("bubble", result["bubble"]),
            ("syncbn", result["syncbn_timeline"]), ("rank0_work", result["rank0_work"]),
            ("uneven_join", uneven["events"]))},
    }


def summarize(m: dict, expected_slope: float) -> str:
    """The chapter's results on one screen."""
    s = m["straggler"]
    lines = [f"straggler (rank {s['slow_rank']} late by d ms), native DDP:",
             "   d (ms)  step (ms)  idle on-time ranks (ms)  idle late rank (ms)"]
    for d, t, i, j in zip(s["delay_ms"], s["step_time_ms"], s["idle_ms_fast_ranks"],
                          s["idle_ms_slow_rank"], strict=True):
        lines.append(f"   {d:6.1f}  {t:9.2f}  {i:23.2f}  {j:19.2f}")
    lines.append(f"   slope of idle vs d: {s['slope_idle']:.3f} native, "
                 f"{s['bucketed']['slope_idle']:.3f} BucketedDDP (expected {expected_slope:g})")
    b = m["syncbn"]["step_time_ms"]
    lines.append(f"BatchNorm {b['bn']:.2f} ms/step, SyncBatchNorm {b['syncbn']:.2f} ms/step")
    r = m["sync_points"]["rank0_work"]
    lines.append(f"rank 0 evaluate+save {r['eval_ms']:.1f} ms; the others waited "
                 f"{r['idle_ms_other_ranks']:.1f} ms")
    u = m["uneven"]
    lines.append(f"uneven inputs {u['batches_per_rank']} batches: with Join "
                 f"{'completed' if u['join_completed'] else 'FAILED'}; without Join: "
                 f"{u['without_join']}")
    lines.append(f"collective on rank 0 only: "
                 f"{m['sync_points']['rank0_only_collective']['what_happened']}")
    return "\n".join(lines)
