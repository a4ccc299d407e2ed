"""Chapter 09's figures, a pure function of the run's results.json.

    training.png    the loss of each hook at every world size of the sweep, and the bytes each
                    hands to all-reduce per step (sweep, training.powersgd_start_iter)
    prediction.png  each hook's time over the whole gradient, measured and predicted by chapter
                    03's α-β-γ model (prediction.per_hook; only when the prediction was made)
    links.png       the reduction's speed-up from compression per link class, for this model
                    and a 1B-parameter one (where_it_pays)

``python scripts/chapter09_compression.py --replot`` redraws them without starting a rank.
"""

from __future__ import annotations

from pathlib import Path

HOOKS = ("none", "fp16", "bf16", "powersgd")  # the chapter script's HOOKS, in drawing order
LABELS = {"none": "no compression", "fp16": "fp16", "bf16": "bf16", "powersgd": "PowerSGD r=2"}


# What the drawing reads from results.json, checked before drawing (ddplab.run.replot).
SCHEMA = {
    "sweep": "dict", "sweep.*": "dict", "sweep.*.*": "dict", "sweep.*.*.loss": "list",
    "training": "dict", "training.powersgd_start_iter": "number",
}


def draw(results: dict, folder: Path) -> list[str]:
    """Every figure of the chapter into ``folder``; returns their file names."""
    sweep = {int(world): runs for world, runs in results["sweep"].items()}
    draw_training(sweep, results["training"]["powersgd_start_iter"], folder / "training.png")
    names = ["training.png"]
    if "per_hook" in results.get("prediction", {}):
        draw_prediction(results["prediction"], folder / "prediction.png")
        names.append("prediction.png")
    if "where_it_pays" in results:
        draw_links(results["where_it_pays"], folder / "links.png")
        names.append("links.png")
    return names


def draw_training(sweep: dict, start_iter: int, path: Path) -> None:
    from ddplab.run import plotting
    worlds = sorted(sweep)
    fig, axes = plotting.figure(1, len(worlds) + 1, height=3.0)
    for ax, world in zip(axes[:-1], worlds, strict=True):
        for name in HOOKS:
            ax.plot(sweep[world][name]["loss"], label=LABELS[name], lw=1)
        ax.set_title(f"{world} rank{'s' if world > 1 else ''}")
        ax.set_xlabel("step")
        ax.axvline(start_iter, color="grey", lw=0.5, ls=":")
    axes[0].set_ylabel("training loss")
    axes[0].legend(fontsize=7)
    top = sweep[max(worlds)]
    ax = axes[-1]
    sent = [top[h]["payload_bytes"] / 2**20 for h in HOOKS]
    ax.bar(range(len(HOOKS)), sent, color="tab:blue")
    ax.set_xticks(range(len(HOOKS)), [LABELS[h].replace(" ", "\n") for h in HOOKS], fontsize=7)
    ax.set_ylabel("MiB handed to all-reduce per step")
    ax.set_title(f"bytes, {max(worlds)} ranks")
    plotting.save(fig, path)


def draw_prediction(pred: dict, path: Path) -> None:
    from ddplab.run import plotting
    fig, ax = plotting.figure(1, 1, height=3.0)
    rows = pred["per_hook"]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["measured_ms"] for r in rows.values()], 0.4,
           label="measured")
    ax.bar([x + 0.2 for x in xs], [r["predicted_ms"] for r in rows.values()], 0.4,
           label="predicted (chapter 03 α-β-γ + compute alone)")
    ax.set_xticks(list(xs), [LABELS[n] for n in rows])
    ax.set_ylabel("one hook over the whole gradient (ms)")
    ax.legend(fontsize=7)
    plotting.save(fig, path)


WHERE = {"h100": "H100 compute (datasheet)", "cpu": "this CPU's compute (measured)"}


def draw_links(pays: dict, path: Path) -> None:
    from ddplab.run import plotting
    fig, axes = plotting.figure(1, 2, height=3.2)
    for ax, model in zip(axes, ("this", "1B"), strict=True):
        table = pays["speedup"][model]
        links = list(table)
        for h, color in (("fp16", "tab:orange"), ("powersgd", "tab:red")):
            for where, ls in (("h100", "-"), ("cpu", "--")):
                ax.plot(links, [table[k][f"{h}_{where}"] for k in links], ls, color=color,
                        marker="o", ms=3, label=f"{LABELS[h]}, {WHERE[where]}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_yscale("log")
        ax.set_title("this model" if model == "this" else "1 B parameters")
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    axes[0].set_ylabel(f"speed-up of the reduction, {pays['world_size']} ranks")
    axes[1].legend(fontsize=6)
    plotting.save(fig, path)
