"""Chapter 04's figures, a pure function of the run's results.json.

    hooks.png         the order the hooks fire in, one forward and one backward (hook_order)
    ready_order.png   when each parameter's gradient became ready, coloured by bucket
    overlap.png       BucketedDDP's all-reduces against backward, with and without overlap
                      (overlap.timelines: every rank's events of the median step)
    bucket_sweep.png  step time against bucket_cap_mb, BucketedDDP and native DDP

``python scripts/chapter04_hooks.py --replot`` redraws them without starting a rank.
"""

from __future__ import annotations

from pathlib import Path

from ddplab.run.timeline import Event

# What the drawing reads from results.json, checked before drawing (ddplab.run.replot).
SCHEMA = {
    "hook_order": "list", "gradient_ready": "dict", "gradient_ready.parameters": "list",
    "overlap": "dict", "overlap.timelines": "dict", "overlap.step_time_ms": "dict",
    "bucket_sweep": "dict", "bucket_sweep.points": "list", "provenance.backend": "str",
}


def draw(results: dict, folder: Path) -> list[str]:
    """Every figure of the chapter into ``folder``; returns their file names."""
    draw_hooks(results["hook_order"], folder / "hooks.png")
    draw_ready_order(results["gradient_ready"], folder / "ready_order.png")
    draw_overlap(results["overlap"], folder / "overlap.png")
    draw_sweep(results["bucket_sweep"], folder / "bucket_sweep.png",
               results["provenance"]["backend"])
    return ["hooks.png", "ready_order.png", "overlap.png", "bucket_sweep.png"]


HOOK_COLORS = {"forward pre-hook": "forward", "forward hook": "forward",
               "tensor hook": "data", "full backward hook": "backward",
               "post-accumulate-grad hook": "comm", "queued callback": "optimizer",
               "backward starts": "wait", "backward returned": "wait"}


def draw_hooks(events: list[dict], path) -> None:
    from ddplab.run import plotting

    fig, ax = plotting.figure(height=0.26 * len(events) + 0.5)
    for i, event in enumerate(events):
        y = len(events) - 1 - i
        color = plotting.COLORS[HOOK_COLORS[event["kind"]]]
        ax.scatter([0], [y], s=60, color=color, zorder=3)
        ax.text(0.07, y, f"{i + 1}.", va="center", ha="right", fontsize=9)
        ax.text(0.08, y, event["kind"], va="center", fontsize=9)
        ax.text(0.5, y, event["where"], va="center", fontsize=9, color="#444444")
    ax.plot([0, 0], [0, len(events) - 1], color="#CCCCCC", zorder=1)
    ax.set_xlim(-0.05, 1.0)
    ax.set_ylim(-0.7, len(events) - 0.3)
    ax.axis("off")
    ax.set_title("The order hooks fire in: one forward and one backward", loc="left")
    plotting.save(fig, path)


def draw_ready_order(ready: dict, path) -> None:
    from ddplab.run import plotting

    params = ready["parameters"]
    fig, ax = plotting.figure(height=0.16 * len(params) + 1.2)
    palette = [plotting.OKABE_ITO[c] for c in ("orange", "blue", "green", "vermillion",
                                               "purple", "sky", "yellow", "black")]
    for i, p in enumerate(params):
        y = len(params) - 1 - i
        color = palette[p["bucket"] % len(palette)]
        ax.barh(y, p["ready_ms"], height=0.7, color=color)
    ax.set_yticks(range(len(params)), [p["name"] for p in reversed(params)], fontsize=7)
    ax.set_xlabel("gradient ready, ms after loss.backward() started")
    ax.set_title(f"Parameters in forward order (top = first layer); colour = bucket "
                 f"({ready['bucket_cap_mb']:g} MiB cap)", fontsize=10)
    buckets = sorted({p["bucket"] for p in params})
    handles = [plotting.plt.Rectangle((0, 0), 1, 1, color=palette[b % len(palette)])
               for b in buckets]
    ax.legend(handles, [f"bucket {b}" + (" (all-reduced first)" if b == 0 else "")
                        for b in buckets], loc="lower right", fontsize=8)
    ax.grid(axis="y", visible=False)
    plotting.save(fig, path)


def draw_step(ax, events: list[Event]) -> None:
    """One row of computation per rank, then one row per bucket (each all-reduce on its own row,
    from this rank's launch to its completion); the wait at the end of backward is labelled."""
    from ddplab.run import plotting

    rows = []
    for rank in sorted({e.rank for e in events}):
        lanes = sorted({e.name for e in events if e.rank == rank and e.cat == "comm"},
                       key=lambda n: (len(n), n))  # bucket 2 before bucket 10
        rows += [(rank, "compute")] + [(rank, lane) for lane in lanes]
    y_of = {row: len(rows) - 1 - i for i, row in enumerate(rows)}
    for e in events:
        y = y_of[(e.rank, e.name if e.cat == "comm" else "compute")]
        ax.broken_barh([(e.start_ms, max(e.duration_ms, 1e-3))], (y - 0.4, 0.8), linewidth=0,
                       color=plotting.COLORS.get(e.cat, plotting.OKABE_ITO["grey"]))
        if e.cat == "wait":  # labelled after the rank's last span, where there is room
            end = max(other.end_ms for other in events if other.rank == e.rank)
            ax.text(end + 1, y, f"wait {e.duration_ms:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(list(y_of.values()),
                  [f"rank {r}" if lane == "compute" else f"  {lane}" for r, lane in y_of],
                  fontsize=8)
    ax.grid(axis="y", visible=False)


def draw_overlap(overlap: dict, path) -> None:
    from matplotlib.patches import Patch

    from ddplab.run import plotting

    keys = [k for k in ("overlap", "no_overlap") if overlap["timelines"].get(k)]
    rows = sum(len({(e["rank"], e["name"]) for e in overlap["timelines"][k]}) for k in keys)
    fig, axes = plotting.figure(len(keys), 1, height=1.2 + 0.16 * rows, sharex=True,
                                layout="constrained", squeeze=False)
    titles = {"overlap": "overlap: each bucket is all-reduced as soon as it is full",
              "no_overlap": "overlap=False: all buckets wait for the end of backward"}
    for ax, key in zip(axes[:, 0], keys, strict=True):
        events = [Event(**e) for e in overlap["timelines"][key]]
        draw_step(ax, events)
        ax.set_title(f"{titles[key]} (median step {overlap['step_time_ms'][key]:.1f} ms)",
                     fontsize=10, loc="left")
    cats = sorted({e["cat"] for k in keys for e in overlap["timelines"][k]})
    axes[-1, 0].set_xlabel("ms since the step started (each rank's clock, started after a "
                           "barrier)")
    fig.legend(handles=[Patch(color=plotting.COLORS.get(c, plotting.OKABE_ITO["grey"]), label=c)
                        for c in cats], loc="outside upper center", ncol=len(cats))
    fig.text(0.5, -0.06, "A bucket's bar runs from this rank's launch to its completion. An "
             "all-reduce completes only once every rank has launched it,\nso the rank that "
             "finishes backward first waits for the other: its bars and its wait are longer.",
             ha="center", va="top", fontsize=8)
    plotting.save(fig, path)


def draw_sweep(sweep: dict, path, backend: str) -> None:
    from ddplab.run import plotting

    fig, ax = plotting.figure(height=3.3)
    caps = [p["bucket_cap_mb"] for p in sweep["points"]]
    for kind, label in (("native", "native DDP"), ("bucketed", "BucketedDDP")):
        values = [p["step_time_ms"][kind] for p in sweep["points"]]
        ax.plot(caps, values, marker="o", color=plotting.COLORS[kind], label=label)
    top = max(max(p["step_time_ms"].values()) for p in sweep["points"])
    for p in sweep["points"]:
        ax.annotate(str(p["buckets"]["bucketed"]), (p["bucket_cap_mb"], top * 1.04),
                    ha="center", fontsize=8, color="#444444")
    ax.axhline(sweep["local_step_time_ms"], color=plotting.COLORS["local"], linestyle="--")
    ax.text(caps[-1], sweep["local_step_time_ms"] * 0.92, "local step, no communication",
            ha="right", va="top", fontsize=8, color=plotting.COLORS["local"])
    ax.axvline(sweep["gradient_mib"], color=plotting.OKABE_ITO["grey"], linestyle=":")
    ax.text(sweep["gradient_mib"] * 1.08, top * 0.3,
            f"all gradients:\n{sweep['gradient_mib']:.1f} MiB", fontsize=8)
    ax.set_xscale("log")
    ax.set_xticks(caps, [f"{c:g}" for c in caps])
    ax.minorticks_off()
    ax.set_xlabel("bucket_cap_mb (MiB)")
    ax.set_ylabel("median step time (ms)")
    ax.set_ylim(0, top * 1.2)
    ax.set_title("Bucket size against step time (small numbers: BucketedDDP's bucket count)",
                 loc="left", fontsize=10)
    if backend == "gloo":  # say it on the figure, not only on the page
        ax.text(0.01, 0.04, "CPU ranks over gloo: communication runs on the same cores as "
                "backward,\nso overlap buys little and no bucket size can win much here",
                transform=ax.transAxes, fontsize=8, color="#444444")
    ax.legend(loc="center left")
    plotting.save(fig, path)
