"""Chapter 07's figures, a pure function of the run's results.json and two files beside it.

    cost.png     how long a save or a load takes, and how many bytes each rank writes
                 (save_phases_ms, dcp, load_ms, checkpoint_mb)
    resume.png   the loss curves of every resume on top of the uninterrupted run, and their
                 distance to it (resume.json: the curves; config.crash_at,
                 resume.resumed_from_step)
    restart.png  where the time went when torchrun restarted the group (restart.json: the
                 restart run's event log and start time; restart.resumed_from_step)

resume.png and restart.png are not drawn when the run skipped the resumes (under torchrun).
``python scripts/chapter07_checkpointing.py --replot`` redraws them without starting a rank.
"""

from __future__ import annotations

from pathlib import Path

from ddplab.run.replot import read_figure_data

# What the drawing reads from results.json, checked before drawing (ddplab.run.replot).
SCHEMA = {
    "config": "dict", "config.crash_at": "number", "restart": "dict", "resume": "dict",
    "dcp": "dict", "save_phases_ms": "dict", "save_phases_ms.*": "number",
    "checkpoint_mb": "number",
}


def draw(results: dict, folder: Path) -> list[str]:
    """Every figure of the chapter into ``folder``; returns their file names."""
    draw_cost(results, folder / "cost.png")
    if "skipped" in results["restart"]:
        return ["cost.png"]
    curves = {name: {int(step): loss for step, loss in series.items()}  # JSON keys are strings
              for name, series in read_figure_data(folder, "resume.json").items()}
    draw_resume(curves, results["config"]["crash_at"], results["resume"]["resumed_from_step"],
                folder / "resume.png")
    draw_restart(read_figure_data(folder, "restart.json"),
                 results["restart"]["resumed_from_step"], folder / "restart.png")
    return ["cost.png", "resume.png", "restart.png"]


def draw_resume(curves: dict, crash_at: int, checkpoint_at: int, path: Path) -> None:
    """Top: loss curves, the resumed ones on top of the uninterrupted one.  Bottom: |difference|."""
    from ddplab.run import plotting

    ok = plotting.OKABE_ITO
    styles = {"uninterrupted": dict(color="#BBBBBB", lw=5, zorder=1),
              "crash (mp.spawn), then rerun": dict(color=ok["blue"], lw=1.6, ls="-"),
              "resumed from DCP": dict(color=ok["green"], lw=1.6, ls=(0, (4, 2))),
              "torchrun restart": dict(color=ok["orange"], lw=1.6, ls=(0, (1, 1.5))),
              "forgot the sampler position": dict(color=ok["vermillion"], lw=1.2, ls="--"),
              "forgot the RNG states": dict(color=ok["purple"], lw=1.2, ls="-.")}
    fig, (top, bottom) = plotting.figure(2, 1, height=6.0, sharex=True,
                                         gridspec_kw={"height_ratios": [3, 2]})
    reference = curves["uninterrupted"]
    for name, series in curves.items():
        steps = sorted(series)
        top.plot(steps, [series[s] for s in steps], label=name, **styles[name])
        if name != "uninterrupted":
            after = [s for s in steps if s >= checkpoint_at]
            bottom.plot(after, [abs(series[s] - reference[s]) for s in after], **styles[name])
    for ax in (top, bottom):
        ax.axvline(crash_at, color=ok["vermillion"], lw=0.8)
        ax.axvspan(checkpoint_at, crash_at, color=plotting.COLORS["idle"], lw=0)
    top.text(crash_at, top.get_ylim()[1], " crash", color=ok["vermillion"], va="top", fontsize=8)
    top.text(checkpoint_at, top.get_ylim()[1], "last checkpoint ", ha="right", va="top",
             fontsize=8, color=ok["grey"])
    top.set_ylabel("training loss\n(mean over ranks)")
    bottom.set_yscale("symlog", linthresh=1e-6)
    bottom.set_ylim(-1e-7, 1)
    bottom.set_ylabel("|loss − uninterrupted|")
    bottom.set_xlabel("optimizer step")
    bottom.text(checkpoint_at, 2e-7, "resumed correctly: exactly 0  ", ha="right", va="bottom",
                fontsize=8)
    handles, labels = top.get_legend_handles_labels()
    bottom.legend(handles, labels, ncols=3, fontsize=8, loc="upper center",
                  bbox_to_anchor=(0.5, -0.35))
    top.set_title("Every correct resume retraces the uninterrupted run exactly")
    plotting.save(fig, path)


def draw_restart(restart: dict, resumed_from: int, path: Path) -> None:
    """Where the time went when torchrun restarted the group: start-up, lost steps, loading."""
    from ddplab.run import plotting

    ok, log, t0 = plotting.OKABE_ITO, restart["log"], restart["started"]
    crash = next(e for e in log if e["event"] == "crash")
    styles = {"start processes (import torch, rendezvous)": ("#DDDDDD", None),
              "build model and data": (ok["purple"], None),
              "load checkpoint": (ok["yellow"], None),
              "training steps": (plotting.COLORS["compute"], None),
              "steps lost, done again": (ok["sky"], "////")}
    fig, ax = plotting.figure(height=2.9)
    labelled = set()

    def bar(y: int, start: float, stop: float, part: str) -> None:
        color, hatch = styles[part]
        ax.barh(y, stop - start, left=start - t0, height=0.5, color=color, hatch=hatch,
                edgecolor="white" if hatch else color, lw=0,
                label=None if part in labelled else part)
        labelled.add(part)

    for y, attempt in ((1, 0), (0, 1)):
        events = [e for e in log if e["attempt"] == attempt]
        at = {e["event"]: e["t"] for e in events if e["event"] in ("boot", "built", "start")}
        finished = {e["step"]: e["t"] for e in events if e["event"] == "step"}  # step -> time
        bar(y, t0 if attempt == 0 else crash["t"], at["boot"],
            "start processes (import torch, rendezvous)")
        bar(y, at["boot"], at["built"], "build model and data")
        bar(y, at["built"], at["start"], "load checkpoint")
        checkpointed = finished.get(resumed_from, at["start"])
        redone = crash["t"] if attempt == 0 else finished[crash["step"]]
        bar(y, at["start"], checkpointed, "training steps")
        bar(y, checkpointed, redone, "steps lost, done again")
        bar(y, redone, max(finished.values()) if attempt else redone, "training steps")
        saves = [e["t"] - t0 for e in events if e["event"] == "save"]
        ax.plot(saves, [y] * len(saves), "|", color=ok["green"], ms=15, mew=2,
                label=None if attempt else "checkpoint saved")
    ax.plot([crash["t"] - t0], [1], "X", color=ok["vermillion"], ms=10,
            label=f"rank {crash['rank']} killed at step {crash['step']}")
    ax.set_yticks([1, 0], ["attempt 0", "attempt 1\n(restarted)"])
    ax.set_xlim(0, None)
    ax.set_ylim(-0.5, 1.5)
    ax.set_xlabel("seconds since torchrun started")
    ax.legend(ncols=2, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    ax.set_title("torchrun --max-restarts 1: the group dies, is restarted, and resumes")
    plotting.save(fig, path)


def draw_cost(metrics: dict, path: Path) -> None:
    """Left: how long a save or a load takes.  Right: how many bytes each rank writes."""
    from ddplab.run import plotting

    ok = plotting.OKABE_ITO
    fig, (left, right) = plotting.figure(1, 2, height=3.4, gridspec_kw={"width_ratios": [3, 2]})
    phase_style = {"collect": ("collect state, gather RNG", ok["purple"]),
                   "write": ("write + SHA-256", ok["blue"]), "fsync": ("fsync", ok["orange"]),
                   "rename": ("rename, checksum file", ok["green"]),
                   "prune_barrier": ("prune, barrier", ok["grey"])}
    edge = 0.0
    for name, value in metrics["save_phases_ms"].items():
        label, color = phase_style[name]
        left.barh(3, value, left=edge, color=color, label=label)
        edge += value
    dcp, whole = metrics["dcp"], ok["sky"]
    left.barh(2, dcp["save_ms"], color=whole)
    left.barh(1, metrics["load_ms"] or 0.0, color=whole)
    left.barh(0, dcp.get("load_ms") or 0.0, color=whole)
    left.set_yticks([3, 2, 1, 0], ["save: rank 0,\ntorch.save", "save: DCP,\nevery rank",
                                   "load: torch.load", "load: DCP"])
    left.set_xlabel("time (ms): saves a median, loads the resume's slowest rank")
    left.legend(fontsize=7, ncols=2, loc="upper center", bbox_to_anchor=(0.45, -0.2))
    left.set_title("How long training waits")

    world = len(dcp["mb_per_rank"])
    groups = {"rank 0\nonly": [metrics["checkpoint_mb"]] + [0.0] * (world - 1),
              "DCP": dcp["mb_per_rank"],
              "every rank\n(pitfall)": [metrics["checkpoint_mb"]] * world}
    width = 0.8 / world
    for r in range(world):
        xs = [i + (r - (world - 1) / 2) * width for i in range(len(groups))]
        right.bar(xs, [v[r] for v in groups.values()], width, color=plotting.rank_color(r),
                  label=f"rank {r}")
    right.set_xticks(range(len(groups)), list(groups))
    right.set_ylabel("MB written per checkpoint")
    right.legend(fontsize=8)
    right.set_title("Who writes what")
    plotting.save(fig, path)
