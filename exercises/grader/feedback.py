"""Feedback figures drawn from what the checks sent back (rank 0's numbers)."""

from __future__ import annotations

import textwrap
from pathlib import Path

TITLE_CHARS = 64  # a line of the 10-point title that fits the 6.4-inch figure, with room to spare


def draw_feedback(chapter: int, verdicts: list, out: Path) -> list[Path]:
    """Draw the figures the chapter's checks asked for; return their paths."""
    wanted = [v for v in verdicts if v.feedback.get("figure")]
    if not wanted:
        return []
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for verdict in wanted:
        fig = draw_figure(verdict.exercise.id, verdict.feedback)
        path = out / f"exercise{verdict.exercise.id.replace('.', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def draw_figure(exercise_id: str, data: dict):
    """One exercise's figure from the numbers its check sent (a matplotlib Figure)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.6), layout="constrained")
    if data["figure"] == "bars":
        ax.bar(data["labels"], data["values"], color=data.get("colors"))
        ax.set_yscale("log")  # 0 (bitwise equal) is drawn as 1e-12
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    else:  # "lines": {"series": {label: [ys]}, "x": [...]}
        for label, ys in data["series"].items():
            ax.plot(data["x"], ys, marker="o", label=label)
        ax.set_xscale("log")
        ax.legend()
    ax.set_xlabel(data.get("xlabel", ""))
    ax.set_ylabel(data.get("ylabel", ""))
    # Wrapped, not clipped: constrained layout makes room for every line of the title.
    title = f"exercise {exercise_id}: {data.get('title', '')}"
    ax.set_title(textwrap.fill(title, TITLE_CHARS), fontsize=10)
    return fig
