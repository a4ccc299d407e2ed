"""Chapter 01's figures, a pure function of the run's files in ``DIR/chapter01/``.

    ranks.png     one box per rank: what each process knows about itself (results.json: ranks)
    replicas.png  the first layer's weights on each rank, for each way of building the replicas
                  (replicas.json, beside results.json: the 8×8 blocks the run gathered)

``python scripts/chapter01_processes.py --replot`` redraws them without starting a rank.
"""

from __future__ import annotations

from pathlib import Path

from ddplab.run.replot import read_figure_data

REPLICA_LABELS = {"same_seed": "same seed", "seed_plus_rank": "seed + rank",
                  "seed_plus_rank_then_broadcast": "seed + rank, then broadcast"}


# What the drawing reads from results.json, checked before drawing (ddplab.run.replot).
SCHEMA = {
    "ranks": "list", "replicas": "dict", "replicas.*": "dict",
}


def draw(results: dict, folder: Path) -> list[str]:
    """Every figure of the chapter into ``folder``; returns their file names."""
    draw_ranks(results["ranks"], folder / "ranks.png")
    weights = read_figure_data(folder, "replicas.json")
    runs = {name: {**run, "weights": weights[name]} for name, run in results["replicas"].items()}
    draw_replicas(runs, folder / "replicas.png")
    return ["ranks.png", "replicas.png"]


def draw_ranks(ranks: list[dict], path) -> None:
    """One box per process, grouped by machine: what each rank knows about itself."""
    from matplotlib.patches import FancyBboxPatch

    from ddplab.run import plotting

    n = len(ranks)
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, ax = plotting.figure(height=0.4 + 1.6 * rows)
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows + 0.35)
    ax.axis("off")
    ax.add_patch(FancyBboxPatch((0.02, 0.05), cols - 0.04, rows + 0.2,
                                boxstyle="round,pad=0.02", fill=False, linestyle="--",
                                edgecolor=plotting.OKABE_ITO["grey"]))
    ax.text(0.06, rows + 0.17, f"machine {ranks[0]['host']}  —  world size {n}, "
            f"backend {ranks[0]['backend']}", fontsize=9, va="center",
            color=plotting.OKABE_ITO["grey"])
    members = {}  # group name -> the global ranks in it
    for r in ranks:
        members.setdefault(r["group"], []).append(r["rank"])
    for r in ranks:
        x, y = r["rank"] % cols, rows - 1 - r["rank"] // cols
        color = plotting.rank_color(r["rank"])
        ax.add_patch(FancyBboxPatch((x + 0.08, y + 0.12), 0.84, 0.86, boxstyle="round,pad=0.02",
                                    facecolor=color, alpha=0.15, edgecolor=color))
        group = ", ".join(map(str, members[r["group"]]))
        lines = [f"rank {r['rank']}", f"local rank {r['local_rank']}",
                 f"pid {r['pid']}", f"{r['device']}, {r['threads']} thread(s)",
                 f"group '{r['group']}' = ranks {{{group}}}",
                 f"rank {r['group_rank']} inside it (size {r['group_size']})",
                 f"its all-reduce of ranks: {r['group_sum_of_ranks']:g}"]
        ax.text(x + 0.5, y + 0.55, "\n".join(lines), ha="center", va="center", fontsize=8)
    plotting.save(fig, path)


def draw_replicas(replica_runs: dict, path, max_ranks: int = 4) -> None:
    """Rows: how the replicas were built.  Columns: ranks.  Cells: first-layer weights."""
    from ddplab.run import plotting

    names = list(replica_runs)
    world = min(len(replica_runs[names[0]]["weights"]), max_ranks)
    fig, axes = plotting.figure(len(names), world, height=1.6 * len(names) + 0.4, squeeze=False)
    for row, name in enumerate(names):
        run = replica_runs[name]
        for rank, block in enumerate(run["weights"][:world]):
            ax = axes[row][rank]
            ax.imshow(block, cmap="cividis", vmin=-0.25, vmax=0.25)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.grid(False)
            ax.spines[:].set_visible(False)
            if row == 0:
                ax.set_title(f"rank {rank}")
            if rank == 0:
                ax.set_ylabel(f"{REPLICA_LABELS[name]}\nmax |Δ| = {run['max_abs_diff']:.3g}",
                              rotation=0, ha="right", va="center", fontsize=9)
    fig.suptitle("First layer's weights (top-left 8×8 block) on each rank")
    plotting.save(fig, path)
