"""Chapter 10's figures, a pure function of the run's results.json.

    links.png       one DDP step per run (one node, two nodes per link rate): compute and the
                    exposed communication measured, next to the cost model (validation.runs)
    projection.png  predicted scaling efficiency from 2 to 1024 GPUs per model and link
                    (projection)

``python scripts/chapter10_many_nodes.py --replot`` redraws them without starting a rank.
"""

from __future__ import annotations

from pathlib import Path

# What the drawing reads from results.json, checked before drawing (ddplab.run.replot).
SCHEMA = {
    "validation": "dict", "validation.runs": "dict", "validation.runs.*": "dict",
    "validation.runs.*.compute_ms": "number", "validation.runs.*.exposed_ms": "number",
    "validation.runs.*.predicted_ms": "number",
}


def draw(metrics: dict, out: Path) -> list[str]:
    import matplotlib.pyplot as plt
    rows = metrics["validation"]["runs"]
    slow = [n for n in rows if n.endswith("100mbit")]
    panels = [[n for n in rows if n not in slow], slow] if slow else [list(rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5, 3.6), squeeze=False,
                             gridspec_kw={"width_ratios": [len(p) for p in panels]})
    for ax, names in zip(axes[0], panels, strict=True):
        xs = range(len(names))
        compute = [rows[n]["compute_ms"] for n in names]
        ax.bar([x - 0.2 for x in xs], compute, 0.4, label="compute (no_sync)", color="#999")
        ax.bar([x - 0.2 for x in xs], [rows[n]["exposed_ms"] for n in names], 0.4,
               bottom=compute, label="exposed communication", color="#d62728")
        ax.bar([x + 0.2 for x in xs], [rows[n]["predicted_ms"] for n in names], 0.4,
               label="cost model", color="#1f77b4")
        ax.set_xticks(list(xs), [n.replace("_", "\n") for n in names])
    axes[0][0].set_ylabel("DDP step time (ms)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("One DDP step: measured (left bar of a pair) vs the cost model (right bar)")
    fig.tight_layout()
    fig.savefig(out / "links.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for name, curve in metrics["projection"].items():
        big = name.startswith("7B")  # 1B and 7B coincide: compute and gradient both grow with P
        ax.plot(curve["gpus"], curve["efficiency"], marker="x" if big else "o", ms=6 if big else 3,
                ls="-" if "ib-ndr" in name else "--", label=name.replace("_", ", "))
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("GPUs (8 per node, NVLink inside)")
    ax.set_ylabel("predicted scaling efficiency")
    ax.set_title("Cost model: compute / step time, 2 → 1024 GPUs")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "projection.png", dpi=120)
    plt.close(fig)
    return ["links.png", "projection.png"]
