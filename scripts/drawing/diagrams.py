"""The book's drawn diagrams: ideas drawn before they are measured (generated, not hand-made).

Each function draws one idea from a few numbers written here, not from a run, and every figure
says so where it could be mistaken for a measurement.  The committed PNGs live in
figures/diagrams/; tests/test_diagrams.py redraws them.

Run it:
    python scripts/drawing/diagrams.py                  # writes figures/diagrams/*.png
    python scripts/drawing/diagrams.py --out /tmp/diagrams
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from matplotlib.patches import FancyBboxPatch, Rectangle

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, run as a script
from ddplab.run import plotting

GREY, DARK = plotting.OKABE_ITO["grey"], "#333333"


def ranks_on_two_nodes(path: Path, nodes: int = 2, gpus: int = 4) -> Path:
    """2 machines × 4 GPUs: every process has a global rank and a local rank."""
    fig, ax = plotting.figure(height=2.6)
    ax.set_xlim(0, nodes * (gpus + 0.6))
    ax.set_ylim(0, 3.1)
    ax.axis("off")
    for node in range(nodes):
        x0 = node * (gpus + 0.6) + 0.1
        ax.add_patch(FancyBboxPatch((x0, 0.25), gpus + 0.2, 2.4, boxstyle="round,pad=0.03",
                                    fill=False, linestyle="--", edgecolor=GREY))
        ax.text(x0 + 0.1, 2.45, f"node {node}: {gpus} GPUs, {gpus} processes",
                fontsize=9, color="#555555")
        for local in range(gpus):
            rank = node * gpus + local
            color = plotting.rank_color(local)  # the same colour: the same local rank
            ax.add_patch(FancyBboxPatch((x0 + 0.2 + local, 0.5), 0.8, 1.6,
                                        boxstyle="round,pad=0.02", facecolor=color, alpha=0.18,
                                        edgecolor=color, linewidth=2.5 if rank == 5 else 1))
            ax.text(x0 + 0.6 + local, 1.3, f"GPU {local}\n\nrank {rank}\nlocal\nrank {local}",
                    ha="center", va="center", fontsize=8.5)
    ax.text(nodes * (gpus + 0.6) / 2, 2.95,
            f"world size {nodes * gpus};  rank = node × {gpus} + local rank;  "
            "same colour = same local rank (= same GPU number)", ha="center", fontsize=9.5)
    return plotting.save(fig, path)


# A model of one backward pass: 8 layers, each 1 time unit of backward and one gradient of one
# unit of bytes.  An all-reduce of k units costs ALPHA + k·BETA (a fixed cost per message plus
# the bytes) and the all-reduces run one at a time, in launch order.
LAYERS, ALPHA, BETA = 8, 0.8, 0.5


def _comm_schedule(bucket_sizes: list[int], overlap: bool = True) -> list[tuple[float, float]]:
    """(start, end) of each bucket's all-reduce; a bucket is ready when its last gradient is."""
    spans, ready, free = [], 0, 0.0
    for size in bucket_sizes:
        ready += size
        start = max(free, ready if overlap else LAYERS)
        free = start + ALPHA + size * BETA
        spans.append((start, free))
    return spans


def overlap_timelines(path: Path) -> Path:
    """Compute against communication: one message per gradient, one bucket, several buckets."""
    cases = [("one all-reduce per gradient\n(8 messages, 8 fixed costs)", [1] * LAYERS),
             ("one bucket\n(waits for the last gradient)", [LAYERS]),
             ("4 buckets (b0–b3) of 2 gradients\n(filled in reverse order)", [2] * 4)]
    fig, ax = plotting.figure(height=3.6)
    for row, (label, sizes) in enumerate(cases):
        y = (len(cases) - 1 - row) * 1.4
        for layer in range(LAYERS):  # backward: the last layer's gradient first
            ax.broken_barh([(layer, 0.96)], (y + 0.55, 0.45), color=plotting.COLORS["backward"])
            ax.text(layer + 0.48, y + 0.77, f"L{LAYERS - layer}", ha="center", va="center",
                    fontsize=7, color="white")
        spans = _comm_schedule(sizes)
        for i, (start, end) in enumerate(spans):  # the fixed cost hatched, then the bytes
            ax.broken_barh([(start, ALPHA)], (y, 0.45), facecolor="white", hatch="////",
                           edgecolor=plotting.COLORS["comm"], linewidth=0)
            ax.broken_barh([(start + ALPHA, end - start - ALPHA - 0.06)], (y, 0.45),
                           color=plotting.COLORS["comm"])
            if len(spans) <= 4:
                ax.text((start + ALPHA + end) / 2, y + 0.22, f"b{i}", ha="center", va="center",
                        fontsize=7)
        end = spans[-1][1]
        if end > LAYERS:
            ax.annotate("", (end, y - 0.08), (LAYERS, y - 0.08),
                        arrowprops={"arrowstyle": "<->", "color": plotting.OKABE_ITO["vermillion"]})
            ax.text((LAYERS + end) / 2, y - 0.32, f"exposed: {end - LAYERS:.1f}", ha="center",
                    fontsize=8, color=plotting.OKABE_ITO["vermillion"])
        ax.text(-0.2, y + 0.5, label, ha="right", va="center", fontsize=8.5)
        ax.axvline(LAYERS, color=GREY, linestyle=":", linewidth=1)
    ax.set_xlim(-0.1, 14.5)
    ax.set_ylim(-0.6, len(cases) * 1.4)
    ax.set_yticks([])
    ax.set_xlabel("time (model units; 1 = one layer's backward)")
    ax.grid(False)
    ax.spines["left"].set_visible(False)
    handles = [Rectangle((0, 0), 1, 1, color=plotting.COLORS[c]) for c in ("backward", "comm")]
    handles.append(Rectangle((0, 0), 1, 1, facecolor="white", hatch="////",
                             edgecolor=plotting.COLORS["comm"]))
    ax.legend(handles, ["backward of one layer", "all-reduce: the bytes (k·β)",
                        "all-reduce: fixed cost per message (α)"], loc="upper right", fontsize=8)
    ax.set_title(f"A model, not a measurement: all-reduce of k gradients costs "
                 f"α + k·β (α = {ALPHA}, β = {BETA})", fontsize=10, loc="left")
    return plotting.save(fig, path)


def bucket_filling(path: Path, per_bucket: int = 2) -> Path:
    """Gradients arrive last layer first; buckets laid out in that order fill one after another."""
    layers = 6
    fig, ax = plotting.figure(height=3.3)
    slots = list(range(layers, 0, -1))  # bucket slots in reverse layer order: L6, L5, …
    for step in range(layers):  # after the gradient of layer `layers - step` is ready
        y = layers - 1 - step
        ax.text(-0.2, y + 0.4, f"L{layers - step}'s gradient ready", ha="right", va="center",
                fontsize=8.5)
        for j, layer in enumerate(slots):
            bucket = j // per_bucket
            x = j + 0.4 * bucket
            filled = j <= step
            color = plotting.rank_color(bucket + 1) if filled else "white"
            ax.add_patch(Rectangle((x, y), 0.92, 0.8, facecolor=color, alpha=0.8 if filled else 1,
                                   edgecolor=GREY))
            ax.text(x + 0.46, y + 0.4, f"L{layer}", ha="center", va="center", fontsize=8)
        if (step + 1) % per_bucket == 0:
            bucket = step // per_bucket
            ax.text(layers + 0.4 * (layers // per_bucket) + 0.1, y + 0.4,
                    f"bucket {bucket} full → all_reduce(bucket {bucket}) starts", va="center",
                    fontsize=8.5, color=plotting.OKABE_ITO["vermillion"])
    for bucket in range(layers // per_bucket):
        x = bucket * per_bucket + 0.4 * bucket + per_bucket / 2
        ax.text(x, layers + 0.1, f"bucket {bucket}", ha="center", fontsize=9)
    ax.set_xlim(-4.2, 12.5)
    ax.set_ylim(-0.3, layers + 0.6)
    ax.axis("off")
    ax.set_title("Backward runs from the last layer to the first; buckets are laid out in that "
                 "order", fontsize=10, loc="left")
    return plotting.save(fig, path)


def allreduce_is_reduce_scatter_plus_all_gather(path: Path, n: int = 4) -> Path:
    """Three states of 4 ranks' tensors, side by side: before, after reduce_scatter, after
    all_gather (= after all_reduce)."""
    fig, axes = plotting.figure(1, 3, height=2.4)
    titles = ["① before", "② = reduce_scatter(①)", "③ = all_gather(②)\n= all_reduce(①)"]
    for panel, (ax, title) in enumerate(zip(axes, titles, strict=True)):
        ax.set_xlim(-1.2, n)
        ax.set_ylim(-0.2, n + 0.2)
        ax.axis("off")
        ax.set_title(title, fontsize=10)
        for rank in range(n):
            y = n - 1 - rank
            ax.text(-0.15, y + 0.4, f"rank {rank}", ha="right", va="center", fontsize=8)
            for chunk in range(n):
                if panel == 0:
                    face, text, color = plotting.rank_color(rank), f"{rank}.{chunk}", "black"
                elif panel == 2 or chunk == rank:
                    face, text, color = DARK, f"Σ{chunk}", "white"
                else:
                    face, text, color = "#EEEEEE", "", "black"
                alpha = 0.35 if panel == 0 else 1.0
                ax.add_patch(Rectangle((chunk, y), 0.92, 0.85, facecolor=face, alpha=alpha,
                                       edgecolor="none"))
                ax.text(chunk + 0.46, y + 0.42, text, ha="center", va="center", fontsize=7.5,
                        color=color)
    fig.text(0.5, -0.02, "r.c = chunk c of rank r's tensor · Σc = chunk c summed over all ranks "
             "· grey: no longer needed (reduce_scatter leaves each rank one summed chunk)",
             ha="center", fontsize=8)
    return plotting.save(fig, path)


DIAGRAMS = {
    "ranks_two_nodes.png": ranks_on_two_nodes,
    "overlap_timelines.png": overlap_timelines,
    "bucket_filling.png": bucket_filling,
    "allreduce_decomposed.png": allreduce_is_reduce_scatter_plus_all_gather,
}


def draw_all(out: Path) -> list[Path]:
    return [draw(out / name) for name, draw in DIAGRAMS.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("figures/diagrams"),
                        help="where the PNGs go (default: figures/diagrams)")
    args = parser.parse_args(argv)
    for path in draw_all(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
