"""Chapter 06's figures, a pure function of the run's results.json.

    timeline_native.png     native DDP, 3 steps, every rank's spans (timelines.native)
    timeline_bucketed.png   BucketedDDP, 3 steps (timelines.bucketed)
    straggler_timeline.png  one rank late every step (timelines.bubble)
    syncbn_timeline.png     SyncBatchNorm with a late rank (timelines.syncbn)
    rank0_work.png          rank 0 evaluates and saves, the others wait (timelines.rank0_work)
    uneven_join.png         uneven inputs finished with Join (timelines.uneven_join)
    straggler.png           step and idle time against the delay (straggler)
    sync_points.png         BatchNorm against SyncBatchNorm (syncbn)

The timelines are stored in results.json (``timelines``: one list of spans per figure).
``python scripts/chapter06_bubbles.py --replot`` redraws them without starting a rank.
"""

from __future__ import annotations

from pathlib import Path

from ddplab import stragglers
from ddplab.run import timeline

LEGEND = {"comm": "all-reduce (comm)", "data": "late: injected delay",
          "idle": "idle: waiting for communication", "wait": "waiting (measured by the wrapper)",
          "eval": "rank 0 only: evaluate + save", "join": "joined: shadowing the others"}


# What the drawing reads from results.json, checked before drawing (ddplab.run.replot).
SCHEMA = {
    "timelines": "dict", "timelines.*": "list", "straggler": "dict",
    "straggler.slow_rank": "number", "straggler.bubble_delay_ms": "number",
    "straggler.delay_ms": "list", "straggler.step_time_ms": "list", "straggler.bucketed": "dict",
    "syncbn": "dict", "syncbn.step_time_ms": "dict",
}


def draw(results: dict, out: Path) -> list[str]:
    """Every figure of the chapter into ``out``; returns their file names."""
    ev = {name: [timeline.Event(**e) for e in events]
          for name, events in results["timelines"].items()}
    slow, late = results["straggler"]["slow_rank"], results["straggler"]["bubble_delay_ms"]
    timelines = {
        "timeline_native.png": (with_idle(ev["native"]),
                                "Native DDP, 3 steps (bucket times from a comm hook)", ("comm",)),
        "timeline_bucketed.png": (ev["bucketed"], "BucketedDDP, 3 steps (its own timeline; "
                                  "grey: waiting for buckets)", ("comm",)),
        "straggler_timeline.png": (with_idle(ev["bubble"]), f"Rank {slow} is {late:g} ms late "
                                   "every step (native DDP)", ("comm",)),
        "syncbn_timeline.png": (ev["syncbn"], f"SyncBatchNorm, rank {slow} {late:g} ms late: "
                                "the others wait in the forward pass", ("comm",)),
        "rank0_work.png": (with_idle(ev["rank0_work"]), "Rank 0 evaluates and saves after "
                           "step 2; the others wait in step 3", ("comm",)),
        "uneven_join.png": (ev["uneven_join"], "Uneven inputs with Join: the rank that runs out "
                            "shadows the others", ()),
    }
    for name, (events, title, lanes) in timelines.items():
        draw_timeline(events, out / name, title, lanes)
    s = results["straggler"]
    draw_straggler({"native": s, "bucketed": s["bucketed"]}, out / "straggler.png")
    draw_sync_points(results["syncbn"], out / "sync_points.png")
    return [*timelines, "straggler.png", "sync_points.png"]


def with_idle(events: list[timeline.Event]) -> list[timeline.Event]:
    """The events plus one 'idle' span per backward: the bubble, drawn on top."""
    return events + stragglers.idle_events(events)


def draw_timeline(events, path: Path, title: str, lanes: tuple[str, ...]) -> None:
    from ddplab.run import plotting

    ranks = len({e.rank for e in events})
    fig, ax = plotting.figure(height=1.0 + 0.4 * ranks * (1 + len(lanes)))
    on_top = sorted(events, key=lambda e: e.cat in ("wait", "idle"))  # drawn over backward
    timeline.draw_gantt(ax, on_top, lanes=list(lanes), title=title, stack_lanes=True)
    ax.set_xlabel("time (ms)")
    for text in ax.get_legend().get_texts():
        text.set_text(LEGEND.get(text.get_text(), text.get_text()))
    plotting.save(fig, path)


def draw_straggler(summaries: dict, path: Path) -> None:
    from ddplab.run import plotting

    fig, (left, right) = plotting.figure(1, 2, height=3.4)
    styles = {"native": ("native DDP", plotting.COLORS["native"], "o"),
              "bucketed": ("BucketedDDP", plotting.COLORS["bucketed"], "s")}
    for kind, s in summaries.items():
        label, color, marker = styles[kind]
        d = s["delay_ms"]
        left.plot(d, s["step_time_ms"], marker=marker, color=color, label=label)
        right.plot(d, s["idle_ms_fast_ranks"], marker=marker, color=color,
                   label=f"{label}, on time ranks")
        right.plot(d, s["idle_ms_slow_rank"], marker=marker, color=color, linestyle=":",
                   label=f"{label}, the late rank")
    native = summaries["native"]
    d = native["delay_ms"]
    for ax, key in ((left, "step_time_ms"), (right, "idle_ms_fast_ranks")):
        base, slope = native[key][0], native["expected_slope"]
        ax.plot(d, [base + slope * x for x in d], color=plotting.OKABE_ITO["grey"],
                linestyle="--", label="expected: slope 1 from d = 0")
        ax.set_xlabel("delay d injected on one rank (ms per step)")
    left.set_ylabel("step time, slowest rank (ms)")
    right.set_ylabel("idle time per step (ms)")
    left.set_title("Every rank's step gets d ms longer")
    right.set_title("The on-time ranks wait d ms more")
    left.legend(fontsize=8)
    right.legend(fontsize=7)
    fig.tight_layout()
    plotting.save(fig, path)


def draw_sync_points(bn: dict, path: Path) -> None:
    """BatchNorm against SyncBatchNorm: step time, the part spent in SyncBN's collectives."""
    from ddplab.run import plotting

    fig, ax = plotting.figure(height=2.6)
    labels = {"bn": "BatchNorm", "syncbn": "SyncBatchNorm"}
    times = bn["step_time_ms"]
    in_comm = {"bn": 0.0, "syncbn": bn["syncbn_collectives_ms"] or 0.0}
    names = list(labels)
    rest = [times[n] - in_comm[n] for n in names]
    ax.barh([labels[n] for n in names], rest, color=plotting.COLORS["backward"], height=0.5,
            label="rest of the step (compute, DDP's overlapped buckets)")
    ax.barh([labels[n] for n in names], [in_comm[n] for n in names], left=rest,
            color=plotting.COLORS["comm"], height=0.5,
            label="inside SyncBatchNorm's blocking all-reduces")
    for i, n in enumerate(names):
        calls = sum(bn["collectives_per_step"][n].values())
        ax.annotate(f" {times[n]:.1f} ms, {calls} collectives per step", (times[n], i),
                    va="center", fontsize=9)
    ax.set_xlim(0, max(times.values()) * 1.6)
    ax.invert_yaxis()
    ax.set_xlabel("median step time (ms)")
    ax.set_title("A small CNN with 3 BatchNorm layers, native DDP")
    ax.grid(axis="y", visible=False)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=2, fontsize=8)
    plotting.save(fig, path)
