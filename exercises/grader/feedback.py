"""Feedback figures drawn from what the checks sent back (rank 0's numbers)."""

from __future__ import annotations

from pathlib import Path


def draw_feedback(chapter: int, verdicts: list, out: Path) -> list[Path]:
    """Draw the figures the chapter's checks asked for; return their paths."""
    wanted = [v for v in verdicts if v.feedback.get("figure")]
    if not wanted:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for verdict in wanted:
        data = verdict.feedback
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
        ax.set_title(f"exercise {verdict.exercise.id}: {data.get('title', '')}", fontsize=10)
        path = out / f"exercise{verdict.exercise.id.replace('.', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
