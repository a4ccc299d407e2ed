"""Chapter 02's figures, a pure function of the run's results.json (``states``).

    <collective>.png  one per collective: what every rank held before and after it, each value
                      coloured by the rank it came from (send_recv, broadcast, scatter, gather,
                      reduce, all_gather, all_reduce, reduce_scatter, all_to_all)

``python scripts/chapter02_collectives.py --replot`` redraws them without starting a rank.
"""

from __future__ import annotations

from pathlib import Path

# The call each figure's title shows (the listings on the page are the real code).
CALLS = {"send_recv": "batch_isend_irecv: isend(t, right), irecv(out, left)",
         "broadcast": "dist.broadcast(t, src=0)", "scatter": "dist.scatter(out, pieces, src=0)",
         "gather": "dist.gather(t, pieces, dst=0)", "reduce": "dist.reduce(t, dst=0)",
         "all_gather": "dist.all_gather(pieces, t)", "all_reduce": "dist.all_reduce(t)",
         "reduce_scatter": "dist.reduce_scatter(out, pieces)",
         "all_to_all": "dist.all_to_all_single(out, t)"}

# What the drawing reads from results.json, checked before drawing (ddplab.run.replot).
SCHEMA = {
    "states": "dict", "states.*": "dict", "states.*.before": "list", "states.*.after": "list",
}


def draw(results: dict, folder: Path) -> list[str]:
    """Every figure of the chapter into ``folder``; returns their file names."""
    names = []
    for name, state in results["states"].items():
        draw_collective(name, state, folder / f"{name}.png")
        names.append(f"{name}.png")
    return names


def classify(value: int, origins: dict[int, int], sums: set[int]) -> str | int:
    """A cell's story: the rank its value came from, 'sum' of all ranks, or 'other'."""
    if value in origins:
        return origins[value]
    return "sum" if value in sums else "other"


def draw_collective(name: str, state: dict, path) -> None:
    """Before → after: rows are ranks; cells are elements, coloured by the rank they came from."""
    from matplotlib.patches import Rectangle

    from ddplab.run import plotting

    n = len(state["before"])
    originals = demo_rows(n)
    origins = {v: r for r, row in enumerate(originals) for v in row}
    sums = {sum(col) for col in zip(*originals, strict=True)}
    width = max(len(r or []) for r in state["before"] + state["after"])
    fig, axes = plotting.figure(1, 2, height=0.55 * n + 0.9)
    for ax, key in zip(axes, ("before", "after"), strict=True):
        ax.axis("off")
        ax.set_xlim(-0.9, width)
        ax.set_ylim(-0.1, n)
        ax.set_title(key + (" →" if key == "before" else ""), fontsize=10)
        for rank, row in enumerate(state[key]):
            y = n - 1 - rank
            ax.text(-0.15, y + 0.45, f"rank {rank}", ha="right", va="center", fontsize=9)
            if row is None:
                ax.text(0.05, y + 0.45, "(no tensor)", va="center", fontsize=8,
                        color=plotting.OKABE_ITO["grey"])
                continue
            for j, value in enumerate(row):
                who = classify(value, origins, sums)
                color = ("#333333" if who == "sum" else plotting.OKABE_ITO["grey"]
                         if who == "other" else plotting.rank_color(who))
                ax.add_patch(Rectangle((j, y), 0.92, 0.88, facecolor=color,
                                       alpha=0.9 if who == "sum" else 0.35, edgecolor="none"))
                ax.text(j + 0.46, y + 0.44, ("Σ " if who == "sum" else "") + str(value),
                        ha="center", va="center", fontsize=8,
                        color="white" if who == "sum" else "black")
    fig.suptitle(f"{name}:  {CALLS[name]}", fontsize=11, family="monospace", y=1.06)
    fig.text(0.5, 0.0, "colour: the rank a value came from   ·   dark Σ: the sum over all ranks"
             "   ·   grey: a partial sum, don't read it", ha="center", va="top", fontsize=8)
    plotting.save(fig, path)


def demo_rows(n: int) -> list[list[int]]:
    base = 10 if n <= 9 else 100
    return [[base * (r + 1) + j for j in range(n)] for r in range(n)]
