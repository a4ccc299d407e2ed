"""Chapter 05's figures, a pure function of the run's results.json.

    equivalence.png  the training loss of every variant, and the distance between their
                     parameters step by step (training.loss, training.max_abs_diff_per_step)
    speed.png        median step time of each variant with its quartiles, and the peak memory
                     each adds per rank (step_time_ms, step_time_quartiles_ms, ratio_to_native,
                     peak_memory_mb)
    scaling.png      training samples per second against world size (scaling.points; not drawn
                     when the sweep was skipped, under torchrun)
    sharding.png     which rank sees which sample, and rank 0's order per epoch (sharding)

``python scripts/chapter05_data_parallel.py --replot`` redraws them without starting a rank.
"""

from __future__ import annotations

from pathlib import Path

from backstage.chapter05_report import LABELS  # each variant's name, on screen too

# The order the figures show the variants in (the chapter script's VARIANTS, MEMORY_VARIANTS
# and SWEPT).
VARIANTS = ("local", "naive", "bucketed", "native")
MEMORY_VARIANTS = (*VARIANTS, "native_view")
SWEPT = ("local", "bucketed", "native")
SHORT = {"local": "local\n(no comm.)", "naive": "Naive", "bucketed": "Bucketed",
         "native": "native", "native_view": "native\nas view"}


# What the drawing reads from results.json, checked before drawing (ddplab.run.replot).
SCHEMA = {
    "training": "dict", "training.loss": "dict", "training.loss.*": "list",
    "training.max_abs_diff_per_step": "dict", "step_time_ms": "dict",
    "step_time_ms.native": "number", "step_time_ms.*": "number",
    "step_time_quartiles_ms": "dict", "sharding": "dict", "sharding.samples": "number",
    "sharding.world_size": "number", "sharding.shards": "dict", "scaling": "dict",
}


def draw(results: dict, folder: Path) -> list[str]:
    """Every figure of the chapter into ``folder``; returns their file names."""
    draw_equivalence(results["training"], folder / "equivalence.png")
    draw_speed(results, folder / "speed.png")
    draw_sharding(results["sharding"], folder / "sharding.png")
    names = ["equivalence.png", "speed.png", "sharding.png"]
    if "points" in results["scaling"]:
        draw_scaling(results["scaling"], folder / "scaling.png")
        names.append("scaling.png")
    return names


def draw_equivalence(training: dict, path) -> None:
    from ddplab.run import plotting

    fig, (ax_loss, ax_diff) = plotting.figure(1, 2, height=3.4, layout="constrained")
    styles = {"native": ("native", "-", 3.0), "naive": ("naive", (0, (4, 3)), 1.6),
              "bucketed": ("bucketed", (0, (1, 2)), 1.8), "single": ("model", "-", 0.8),
              "no_sync": ("data", (0, (6, 2, 1, 2)), 1.2)}
    for kind, (color, style, width) in styles.items():
        values = training["loss"][kind]
        ax_loss.plot(range(1, len(values) + 1), values, color=plotting.COLORS[color],
                     linestyle=style, linewidth=width, label=LABELS[kind])
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("training loss (global batch)")
    ax_loss.set_title("Five ways to train: one curve")
    ax_loss.legend(fontsize=7.5, loc="upper right")

    per_step = training["max_abs_diff_per_step"]
    zero = []
    for key, color, label in (("naive_vs_native", "naive", "NaiveDDP vs native"),
                              ("bucketed_vs_native", "bucketed", "BucketedDDP vs native"),
                              ("ddp_vs_single_process", "model", "native vs one process"),
                              ("no_sync_vs_large_batch", "data", "no_sync vs one batch")):
        values = per_step[key]
        if max(values) == 0.0:
            zero.append(label)
            continue
        ax_diff.plot(range(1, len(values) + 1), [max(v, 1e-12) for v in values],
                     color=plotting.COLORS[color], label=label)
    ax_diff.set_yscale("log")
    ax_diff.set_ylim(1e-10, 1e-3)
    ax_diff.set_xlabel("optimizer step")
    ax_diff.set_ylabel(r"max $|\theta - \theta_{\mathrm{reference}}|$")
    ax_diff.set_title("Distance between parameters")
    if zero:
        ax_diff.text(0.03, 0.95, "exactly 0 at every step:\n" + "\n".join(zero),
                     transform=ax_diff.transAxes, va="top", fontsize=8,
                     bbox={"facecolor": "white", "edgecolor": "#CCCCCC"})
    ax_diff.legend(fontsize=7.5, loc="lower right")
    plotting.save(fig, path)


def draw_speed(result: dict, path) -> None:
    from ddplab.run import plotting

    fig, (ax_time, ax_mem) = plotting.figure(1, 2, height=3.3, layout="constrained",
                                             gridspec_kw={"width_ratios": [4, 3]})
    times = result["step_time_ms"]
    quart = result["step_time_quartiles_ms"]
    names = [SHORT[k] for k in VARIANTS]
    bars = ax_time.bar(names, [times[k] for k in VARIANTS],
                       color=[plotting.COLORS[k] for k in VARIANTS],
                       yerr=[[times[k] - quart[k][0] for k in VARIANTS],
                             [quart[k][1] - times[k] for k in VARIANTS]], capsize=3)
    for bar, kind in zip(bars, VARIANTS, strict=True):
        ratio = 1.0 if kind == "native" else result["ratio_to_native"][kind]
        ax_time.annotate(f"{times[kind]:.1f} ms\n×{ratio:.2f}", (bar.get_x() + bar.get_width() / 2,
                         quart[kind][1]), xytext=(0, 3), textcoords="offset points",
                         ha="center", va="bottom", fontsize=8)
    ax_time.set_ylabel("median step time (ms)")
    ax_time.set_title("Step time (×: ratio to native)")
    ax_time.set_ylim(0, max(q[1] for q in quart.values()) * 1.3)
    ax_time.tick_params(axis="x", labelsize=8)

    memory = result["peak_memory_mb"]
    if memory:
        kinds = list(MEMORY_VARIANTS)
        x = range(len(kinds))
        for offset, phase, hatch in ((-0.2, "setup", "//"), (0.2, "steady", "")):
            values = [memory[k][phase] for k in kinds]
            bars = ax_mem.bar([i + offset for i in x], values, width=0.4, hatch=hatch,
                              color=[plotting.COLORS[k.split("_")[0]] for k in kinds],
                              edgecolor="white")
            for bar, value in zip(bars, values, strict=True):
                ax_mem.annotate(f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, value),
                                xytext=(0, 2), textcoords="offset points", ha="center",
                                va="bottom", fontsize=7)
        ax_mem.set_xticks(list(x), [SHORT[k] for k in kinds])
        top = max(v for k in kinds for v in memory[k].values())
        ax_mem.set_ylim(0, top * 1.25)
    else:
        ax_mem.text(0.5, 0.5, "peak memory needs Linux /proc\nor a GPU", ha="center",
                    transform=ax_mem.transAxes)
    ax_mem.set_ylabel("peak memory added (MiB)")
    ax_mem.set_title("Peak memory per rank\n(hatched: setup; plain: steady state)")
    ax_mem.tick_params(axis="x", labelsize=8)
    plotting.save(fig, path)


def draw_scaling(scaling: dict, path) -> None:
    from ddplab.run import plotting

    fig, ax = plotting.figure(height=3.3)
    points = scaling["points"]
    sizes = [p["world_size"] for p in points]
    base = points[0]["samples_per_s"]["local"] / points[0]["world_size"]
    ax.plot(sizes, [base * n for n in sizes], linestyle=":", color=plotting.OKABE_ITO["grey"],
            label="linear: N × one rank without communication")
    for kind in SWEPT:
        values = [p["samples_per_s"][kind] for p in points]
        ax.plot(sizes, values, marker="o", color=plotting.COLORS[kind], label=LABELS[kind])
    cores = scaling.get("cpu_count") if scaling.get("threads_per_rank") else None
    if cores and sizes[-1] > cores:
        ax.axvspan(cores * 1.2, sizes[-1] * 1.25, color=plotting.COLORS["idle"], zorder=0)
        ax.text(cores * 1.25, base * 0.15, f"more ranks than\n{cores} CPU cores:\nthey take turns",
                fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.minorticks_off()
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("training samples per second")
    per_rank = f"{scaling['per_rank_batch']} samples per rank per step"
    if scaling.get("threads_per_rank"):
        per_rank += ", one core per rank"
    ax.set_title(f"Throughput ({per_rank})")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left")
    plotting.save(fig, path)


def draw_sharding(sharding: dict, path) -> None:
    from matplotlib.patches import Rectangle

    from ddplab.run import plotting

    fig, (ax, ax_epoch) = plotting.figure(1, 2, height=3.4, gridspec_kw={"width_ratios": [3, 2]})
    titles = {"manual": "manual slices", "padded": "DistributedSampler\n(drop_last=False)",
              "drop_last": "DistributedSampler\n(drop_last=True)"}
    n, world = sharding["samples"], sharding["world_size"]
    cmap = plotting.plt.get_cmap("cividis")
    y = 0.0
    for how, shards in sharding["shards"].items():
        twice = set(sharding["seen_twice"][how])
        for rank, shard in enumerate(shards):
            for pos, i in enumerate(shard):
                repeated = i in twice
                ax.add_patch(Rectangle((pos, -y - rank), 0.92, 0.85, facecolor=cmap(i / n),
                                       edgecolor=plotting.COLORS["naive"] if repeated else "none",
                                       linewidth=2.2 if repeated else 0))
                ax.text(pos + 0.46, -y - rank + 0.42, str(i), ha="center", va="center",
                        fontsize=8, color="white" if i < n * 0.55 else "black")
            ax.text(-0.2, -y - rank + 0.42, f"rank {rank}", ha="right", va="center", fontsize=8)
        missing = sharding["never_seen"][how]
        note = f"never seen: {missing}" if missing else "every sample seen,"
        if twice:
            note += f"\n{sorted(twice)} twice (outlined)"
        ax.text(5.1, -y - world / 2 + 0.9, f"{titles[how]}\n{note}", va="center", fontsize=8)
        y += world + 0.8
    ax.set_xlim(-1.6, 10.5)
    ax.set_ylim(-y + 0.6, 1.1)
    ax.axis("off")
    ax.set_title(f"{n} samples on {world} ranks", loc="left")

    orders = sharding["rank0_order_by_epoch"]
    for row, (flag, label) in enumerate((("with_set_epoch", "with set_epoch(e)"),
                                         ("without_set_epoch", "without set_epoch"))):
        for epoch, order in enumerate(orders[flag]):
            yy = -(row * 4.2 + epoch)
            for pos, i in enumerate(order):
                ax_epoch.add_patch(Rectangle((pos, yy), 0.92, 0.85, facecolor=cmap(i / 12)))
                ax_epoch.text(pos + 0.46, yy + 0.42, str(i), ha="center", va="center",
                              fontsize=8, color="white" if i < 12 * 0.55 else "black")
            ax_epoch.text(-0.2, yy + 0.42, f"epoch {epoch}", ha="right", va="center", fontsize=8)
        ax_epoch.text(0, -(row * 4.2) + 1.15, label, fontsize=9, fontweight="bold")
    ax_epoch.set_xlim(-2.2, 6.2)
    ax_epoch.set_ylim(-7.6, 2.0)
    ax_epoch.axis("off")
    ax_epoch.set_title("Rank 0's samples per epoch\n(12 samples, 2 ranks, shuffled)", loc="left")
    plotting.save(fig, path)
