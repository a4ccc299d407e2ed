"""Chapter 03's figures, a pure function of the run's files in ``DIR/chapter03/``.

    ring_steps.png  the ring's state after every step (ring_steps.json, beside results.json: the
                    trace of the largest world size run)
    time.png        time per all-reduce against size, with the fitted α-β-γ model (results.json)
    busbw.png       bus bandwidth against size
    segments.png    the ring's bus bandwidth for each segment size
    scaling.png     time per all-reduce against the world size (absent under torchrun)

``python scripts/chapter03_ring_allreduce.py --replot`` redraws them without starting a rank.
"""

from __future__ import annotations

import math
from pathlib import Path

from backstage.chapter03 import bandwidth_text, label_bytes  # the chapter's words for both
from ddplab.run.replot import read_figure_data

LABELS = {"ring": "ring_all_reduce (ours)", "native": "dist.all_reduce (gloo)",
          "naive": "naive: via rank 0"}
COLOR_KEYS = {"ring": "ring", "native": "native", "naive": "naive_allreduce"}


# What the drawing reads from results.json, checked before drawing (ddplab.run.replot).
SCHEMA = {
    "provenance.world_size": "number", "provenance.backend": "str",
    "sizes_bytes": "list", "time_ms": "dict", "time_ms.*": "dict", "time_ms.*.*": "number",
    "busbw_gbps": "dict", "busbw_gbps.*": "dict", "alpha_beta": "dict",
    "alpha_beta.*.predicted_ms": "dict", "segments": "dict", "segments.rows": "list",
    "segments.size_bytes": "number", "scaling": "dict",
}


def draw(results: dict, folder: Path) -> list[str]:
    """Every figure of the chapter into ``folder``; returns their file names."""
    world = results["provenance"]["world_size"]
    draw_trace(read_figure_data(folder, "ring_steps.json"), folder / "ring_steps.png")
    draw_time(results, world, folder / "time.png")
    draw_busbw(results, world, folder / "busbw.png")
    draw_segments(results["segments"], folder / "segments.png")
    names = ["ring_steps.png", "time.png", "busbw.png", "segments.png"]
    if "skipped" not in results["scaling"]:  # under torchrun there is no world-size sweep
        prov = results["provenance"]
        hardware = ("one GPU per rank" if prov["backend"] == "nccl"
                    else f"this machine has {prov['cpu_count']} cores")
        draw_scaling(results["scaling"], folder / "scaling.png", hardware)
        names.append("scaling.png")
    return names


def size_ticks(ax, sizes: list[int]) -> None:
    ticks = [s for s in sizes if math.log2(s) % 2 == 0]
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([label_bytes(s) for s in ticks])
    ax.minorticks_off()


def draw_time(analysis: dict, world: int, path) -> None:
    from ddplab.run import plotting

    sizes = analysis["sizes_bytes"]
    fig, ax = plotting.figure(height=3.6)
    for name in analysis["time_ms"]:
        color = plotting.COLORS[COLOR_KEYS[name]]
        times = [analysis["time_ms"][name][str(s)] for s in sizes]
        ax.plot(sizes, times, "o", color=color, label=LABELS[name], markersize=4)
        fit = analysis["alpha_beta"].get(name)
        if fit:
            predicted = [fit["predicted_ms"][str(s)] for s in sizes]
            ax.plot(sizes, predicted, "--", color=color, linewidth=1,
                    label=f"  fit: α = {fit['alpha_us']:.0f} µs, 1/β = "
                          f"{bandwidth_text(fit['beta_gbps'])}, weighted R² = {fit['r2']:.2f}")
    size_ticks(ax, sizes)
    ax.set_yscale("log")
    ax.set_xlabel("tensor size S")
    ax.set_ylabel("time per all-reduce (ms)")
    ax.set_title(f"All-reduce time, {world} ranks (10th percentile of the rounds; "
                 "dashed: α-β-γ model)")
    ax.legend(fontsize=8)
    plotting.save(fig, path)


def draw_busbw(analysis: dict, world: int, path) -> None:
    from ddplab.run import plotting

    sizes = analysis["sizes_bytes"]
    fig, ax = plotting.figure(height=3.2)
    for name in analysis["busbw_gbps"]:
        bw = [analysis["busbw_gbps"][name][str(s)] for s in sizes]
        ax.plot(sizes, bw, "o-", color=plotting.COLORS[COLOR_KEYS[name]], label=LABELS[name],
                markersize=4)
    size_ticks(ax, sizes)
    ax.set_xlabel("tensor size S")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"busbw = S / t · 2(N-1)/N, {world} ranks (higher is better)")
    if world == 1:
        ax.text(0.5, 0.5, "1 rank: nothing crosses a link,\nso busbw is not defined",
                ha="center", va="center", transform=ax.transAxes)
    ax.legend()
    plotting.save(fig, path)


def draw_segments(segments: dict, path) -> None:
    from ddplab.run import plotting

    rows = segments["rows"]
    fig, ax = plotting.figure(height=2.8)
    x = range(len(rows))
    ax.bar(x, [r["busbw_gbps"] for r in rows], color=plotting.COLORS["ring"], width=0.6,
           label="ring_all_reduce")
    ax.axhline(segments["native_busbw_gbps"], color=plotting.COLORS["native"], linestyle="--",
               label="dist.all_reduce (gloo: 1 MiB segments)")
    ax.set_xticks(list(x))
    default = segments["default_segment"]
    ax.set_xticklabels([r["segment_label"] + ("\n(default)" if r["segment_label"] == default
                                              else "") for r in rows])
    top = max(segments["native_busbw_gbps"], *(r["busbw_gbps"] for r in rows))
    ax.set_ylim(0, 1.35 * top or 1)  # busbw is 0 on one rank: nothing crosses a link
    ax.set_xlabel("segment size (the largest message the ring sends)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"Ring all-reduce of {label_bytes(segments['size_bytes'])}: "
                 "how big should one message be?")
    ax.legend(loc="upper left", ncol=2)
    plotting.save(fig, path)


def draw_scaling(scaling: dict, path, hardware: str) -> None:
    from ddplab.run import plotting

    worlds = scaling["world_sizes"]
    fig, ax = plotting.figure(height=3.0)
    for name in scaling["time_ms"]:
        times = [scaling["time_ms"][name][str(w)] for w in worlds]
        ax.plot(worlds, times, "o-", color=plotting.COLORS[COLOR_KEYS[name]], label=LABELS[name])
    ax.set_xticks(worlds)
    ax.set_xlabel(f"world size N ({hardware})")
    ax.set_ylabel("time per all-reduce (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"All-reduce of {label_bytes(scaling['size_bytes'])} as ranks are added")
    ax.legend()
    plotting.save(fig, path)


def draw_trace(trace: list[list[dict]], path) -> None:
    """One panel per step: rows are ranks, columns chunks; a cell shows whose data it sums."""
    from matplotlib.patches import Rectangle

    from ddplab.run import plotting

    world = len(trace)
    cols = max(world, 3)
    fig, axes = plotting.figure(2, cols, height=2 * plotting.PAGE_WIDTH_IN / cols + 0.5,
                                squeeze=False)
    # Top row: the start and the reduce-scatter steps; bottom row: the all-gather steps.
    panels = [axes[0][i] for i in range(world)] + [axes[1][i] for i in range(1, world)]
    for ax in axes.flat:
        ax.axis("off")
    fontsize = 8 if world <= 3 else 6
    for i, ax in enumerate(panels[: len(trace[0])]):
        state = [trace[rank][i] for rank in range(world)]
        for rank, s in enumerate(state):
            y = world - 1 - rank  # rank 0 on top
            for chunk, mask in enumerate(s["masks"]):
                members = [r for r in range(world) if mask >> r & 1]
                done = len(members) == world
                ax.add_patch(Rectangle(
                    (chunk, y), 0.94, 0.9, edgecolor="none",
                    facecolor=plotting.COLORS["ring"] if done else plotting.OKABE_ITO["sky"],
                    alpha=1.0 if done else 0.15 + 0.6 * len(members) / world))
                if s["received"] == chunk:  # arrived this step: outlined in the comm colour
                    ax.add_patch(Rectangle((chunk, y), 0.94, 0.9, fill=False, linewidth=2,
                                           edgecolor=plotting.COLORS["comm"]))
                ax.text(chunk + 0.47, y + 0.45, "Σ" if done else "+".join(map(str, members)),
                        ha="center", va="center", fontsize=fontsize,
                        color="white" if done else "black")
        ax.set_xlim(-0.05, world)
        ax.set_ylim(-0.05, world + 0.05)
        ax.set_aspect("equal")
        phase = state[0]["phase"]
        ax.set_title("start" if phase == "start" else f"{phase} {state[0]['step'] + 1}",
                     fontsize=9)
    axes[1][0].text(0.0, 0.5, f"rows: ranks 0–{world - 1}\ncolumns: chunks 0–{world - 1}\n"
                    "cell: ranks summed in it\nΣ: all ranks\norange: arrived\n   this step",
                    fontsize=8, va="center", transform=axes[1][0].transAxes)
    fig.suptitle(f"Ring all-reduce on {world} ranks, recorded step by step", fontsize=11)
    plotting.save(fig, path)
