"""Chapter 11's figures, a pure function of the run's results.json.

    ledger_formula.png  drawn: what a rank holds under DDP and ZeRO-1/2/3, from the ZeRO paper's
                        formula (ledger.paper: 7.5 B parameters on 64 ranks, as the paper's
                        figure 1)
    ledger.png          measured: the bytes every rank holds after a step, by kind, and the
                        profiler's peak, per stage (ledger.per_rank)
    gathers.png         drawn: one FSDP step, layer by layer: all-gather, compute, free;
                        re-gather in backward, reduce-scatter (communication.timeline.layers)
    timeline.png        measured: the same step of FullyShardedDP on rank 0, its gathers,
                        forwards and reduce-scatters timed (communication.timeline.events)
    halves.png          the ring's reduce-scatter and all-gather against gloo's, per size
                        (communication.ring_halves; not drawn when the halves were skipped)
"""

from __future__ import annotations

from pathlib import Path

STAGES = ("ddp", "zero1_ours", "zero1_native", "zero2", "fsdp_ours", "fully_shard")
SHORT = {"ddp": "DDP", "zero1_ours": "ZeRO-1\nours", "zero1_native": "ZeRO-1\nZeroRedundancy",
         "zero2": "ZeRO-2\nours", "fsdp_ours": "FSDP\nours", "fully_shard": "FSDP\nfully_shard"}
KINDS = ("params", "grads", "optimizer_state", "counters")
KIND_LABELS = {"params": "parameters", "grads": "gradients", "optimizer_state": "optimizer state",
               "counters": "Adam's step counters"}

# What the drawing reads from results.json, checked before drawing (ddplab.run.replot).
SCHEMA = {
    "ledger": "dict", "ledger.paper": "dict", "ledger.paper.mixed_adam": "list",
    "ledger.per_rank": "list", "ledger.numel": "number",
    "communication": "dict", "communication.timeline": "dict",
    "communication.timeline.layers": "list", "communication.timeline.events": "list",
    "communication.timeline.backward_starts_ms": "number",
    "communication.timeline.end_ms": "number", "communication.ring_halves": "dict",
}


def draw(results: dict, folder: Path) -> list[str]:
    """Every figure of the chapter into ``folder``; returns their file names."""
    draw_ledger_formula(results["ledger"]["paper"]["mixed_adam"], folder / "ledger_formula.png")
    draw_ledger(results["ledger"], folder / "ledger.png")
    draw_gathers(results["communication"]["timeline"]["layers"], folder / "gathers.png")
    draw_timeline(results["communication"]["timeline"], folder / "timeline.png")
    names = ["ledger_formula.png", "ledger.png", "gathers.png", "timeline.png"]
    if "sizes" in results["communication"]["ring_halves"]:
        draw_halves(results["communication"]["ring_halves"], folder / "halves.png")
        names.append("halves.png")
    return names


def _kind_colors():
    from ddplab.run import plotting
    o = plotting.OKABE_ITO
    return {"params": o["blue"], "grads": o["orange"], "optimizer_state": o["green"],
            "counters": o["grey"]}


def draw_ledger_formula(paper: list, path) -> None:
    from ddplab.run import plotting

    fig, ax = plotting.figure(height=3.0)
    colors, names = _kind_colors(), ["DDP", "ZeRO-1\n(optimizer state)",
                                     "ZeRO-2\n(+ gradients)", "ZeRO-3 / FSDP\n(+ parameters)"]
    for i, stage in enumerate(paper):
        bottom = 0.0
        for kind in ("params", "grads", "optimizer_state"):
            gb = stage[kind] / 1e9
            ax.bar(i, gb, bottom=bottom, color=colors[kind],
                   label=KIND_LABELS[kind] if i == 0 else None)
            bottom += gb
        ax.annotate(f"{bottom:.1f} GB", (i, bottom), xytext=(0, 3), textcoords="offset points",
                    ha="center", fontsize=9)
    ax.set_xticks(range(len(paper)), names)
    ax.set_ylabel("bytes per rank (GB)")
    ax.set_title("The formula: 7.5 B parameters, mixed-precision Adam (2+2+12 B), 64 ranks")
    ax.legend(loc="upper right")
    plotting.save(fig, path)


def draw_ledger(ledger: dict, path) -> None:
    from ddplab.run import plotting

    per_rank = ledger["per_rank"]
    world = len(per_rank)
    fig, ax = plotting.figure(height=3.6)
    colors, width = _kind_colors(), 0.8 / world
    for s, stage in enumerate(STAGES):
        for r, rank in enumerate(per_rank):
            x, bottom = s + (r - (world - 1) / 2) * width, 0.0
            for kind in KINDS:
                kib = rank[stage]["held"][kind] / 1024
                ax.bar(x, kib, width * 0.9, bottom=bottom, color=colors[kind],
                       label=KIND_LABELS[kind] if s == r == 0 else None)
                bottom += kib
            peak = rank[stage]["profiler_peak"] / 1024
            ax.plot([x - width * 0.45, x + width * 0.45], [peak, peak], color="black",
                    linewidth=1.2, label="profiler peak of the run" if s == r == 0 else None)
            exact = rank[stage]["held"] == rank[stage]["predicted"]
            ax.text(x, bottom, "=" if exact else "≠", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(STAGES)), [SHORT[s] for s in STAGES], fontsize=8)
    ax.set_ylabel("KiB per rank")
    top = max(rank[s]["profiler_peak"] for rank in per_rank for s in STAGES) / 1024
    ax.set_ylim(0, top * 1.45)
    ax.set_title(f"Measured: every byte each of {world} ranks holds after a step "
                 "(=: equal to the formula)", fontsize=9.5)
    ax.legend(fontsize=7.5, loc="upper center", ncols=3)
    plotting.save(fig, path)


def draw_gathers(layers: list, path) -> None:
    """A schematic (not measured): equal boxes, the order of the work on one rank."""
    from matplotlib.patches import Rectangle

    from ddplab.run import plotting

    o = plotting.OKABE_ITO
    fig, ax = plotting.figure(height=2.6)
    rows = {"all-gather": 2, "compute": 1, "reduce-scatter": 0}
    colors = {"all-gather": o["orange"], "compute": o["blue"], "reduce-scatter": o["vermillion"]}
    t, n = 0.0, len(layers)
    schedule = []
    for i in range(n):  # forward: gather layer i+1 while layer i computes (prefetch)
        if i == 0:
            schedule.append(("all-gather", 0, t, 1.0))
            t += 1.0
        if i + 1 < n:
            schedule.append(("all-gather", i + 1, t, 1.0))
        schedule.append(("compute", i, t, 1.0))
        t += 1.0
    schedule.append(("all-gather", n - 1, t, 1.0))  # freed after forward: gathered again
    t += 1.0
    for i in reversed(range(n)):  # backward: gather the next (earlier) layer, reduce this one
        if i - 1 >= 0:
            schedule.append(("all-gather", i - 1, t, 1.0))
        schedule.append(("compute", i, t, 2.0))
        schedule.append(("reduce-scatter", i, t + 2.0, 1.0))
        t += 2.0
    t += 1.0
    for kind, layer, start, length in schedule:
        y = rows[kind]
        ax.add_patch(Rectangle((start, y + 0.1), length * 0.95, 0.8, color=colors[kind]))
        ax.text(start + length * 0.47, y + 0.5, str(layer), ha="center", va="center",
                color="white", fontsize=8)
    ax.axvline(n + 1, color="black", linestyle=":", linewidth=1)
    ax.text(n + 1.1, 3.05, "backward starts", fontsize=8, va="top")
    ax.set_yticks([0.5, 1.5, 2.5], ["reduce-scatter", "compute", "all-gather"])
    ax.set_xlim(0, t + 1.2)
    ax.set_ylim(0, 3.2)
    ax.set_xticks([])
    ax.grid(False)
    ax.set_title(f"Drawn, not measured: one FSDP step over {n} layers (numbers: layer), "
                 "the next layer's gather prefetched", fontsize=9.5)
    plotting.save(fig, path)


def draw_timeline(timeline: dict, path) -> None:
    from ddplab.run import plotting

    o = plotting.OKABE_ITO
    rows = {"all-gather": 2, "forward": 1, "reduce-scatter": 0}
    colors = {"all-gather": o["orange"], "forward": o["sky"], "reduce-scatter": o["vermillion"]}
    layers = timeline["layers"]
    fig, ax = plotting.figure(height=2.6)
    for e in timeline["events"]:
        y = rows[e["kind"]]
        ax.barh(y, e["end_ms"] - e["start_ms"], left=e["start_ms"], height=0.7,
                color=colors[e["kind"]])
        ax.text((e["start_ms"] + e["end_ms"]) / 2, y, str(layers.index(e["layer"])),
                ha="center", va="center", fontsize=7, color="black")
    ax.axvline(timeline["backward_starts_ms"], color="black", linestyle=":", linewidth=1)
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_xlim(0, timeline["end_ms"] * 1.02)
    ax.set_xlabel("ms since the step began (rank 0); dotted: backward starts")
    ax.set_title("Measured: FullyShardedDP's gathers and reduce-scatters, layer by layer",
                 fontsize=9.5)
    plotting.save(fig, path)


def draw_halves(halves: dict, path) -> None:
    from ddplab.run import plotting

    o = plotting.OKABE_ITO
    fig, ax = plotting.figure(height=3.0)
    keys = {"ring_reduce_scatter": ("our ring reduce-scatter", o["blue"], "-"),
            "gloo_reduce_scatter": ("gloo reduce-scatter", o["vermillion"], "-"),
            "gloo_all_reduce": ("gloo all-reduce", o["grey"], ":"),
            "ring_all_gather": ("our ring all-gather", o["blue"], "--"),
            "gloo_all_gather": ("gloo all-gather", o["vermillion"], "--")}
    sizes = [row["bytes"] / 2**20 for row in halves["sizes"]]
    for key, (label, color, style) in keys.items():
        ax.plot(sizes, [row["median_ms"][key] for row in halves["sizes"]], marker="o",
                color=color, linestyle=style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("input per rank (MiB); all-gather's output is N× larger")
    ax.set_ylabel("median ms per call")
    ax.set_title("The ring's two halves against gloo's collectives")
    ax.legend(fontsize=8)
    plotting.save(fig, path)
