"""Chapter 05's summary: its results.json on one screen, read by the launching process.

Equivalence (max |Δ parameter| of each variant against native DDP, with a verdict), speed
(median step times and why NaiveDDP is slower), peak memory, and the throughput sweep; and
``memory_results``, the peak-memory part of results.json.
"""

from __future__ import annotations


def memory_results(peaks: dict, setup_steps: int, steady_steps: int, fresh: bool) -> dict:
    """Each variant's peak memory (setup, steady state), and its ratio to native DDP's."""
    native = peaks["native"]
    return {"peak_memory_mb": peaks,
            "memory_ratio_to_native": {k: {phase: v[phase] / native[phase] if native[phase]
                                           else None for phase in v}
                                       for k, v in peaks.items()},
            "memory": {"setup_steps": setup_steps, "steady_steps": steady_steps,
                       "fresh_process_per_variant": fresh}}


def verdict(value: float) -> str:
    return "bit for bit" if value == 0.0 else "float rounding" if value < 1e-4 else "DIFFERENT"


def summarize(r: dict, prov: dict, labels: dict, variants: tuple, memory_variants: tuple) -> str:
    """The chapter's results on one screen (``labels``: each variant's name in the figures)."""
    m, eq, tr = r["model"], r["equivalence"], r["training"]
    why = r["why_naive_is_slower"]
    lines = [
        f"Chapter 05 — {prov['world_size']} ranks on {prov['backend']} ({prov['device']}), "
        f"{m['name']} with {m['parameters'] / 1e6:.2f} M parameters in "
        f"{m['parameter_tensors']} tensors",
        "",
        f"Same numbers? max |Δ parameter| after {tr['steps']} steps (global batch "
        f"{tr['global_batch']}):",
        f"  NaiveDDP    vs native DDP             {eq['naive_vs_native']:<10.3g} "
        f"{verdict(eq['naive_vs_native'])}",
        f"  BucketedDDP vs native DDP             {eq['bucketed_vs_native']:<10.3g} "
        f"{verdict(eq['bucketed_vs_native'])}",
        f"  native DDP  vs one process            {eq['ddp_vs_single_process']:<10.3g} "
        f"{verdict(eq['ddp_vs_single_process'])}"
        + (" (different summation order)" if eq["ddp_vs_single_process"] else ""),
        f"  no_sync × {tr['micro_batches']} vs one large batch       "
        f"{eq['no_sync_vs_large_batch']:<10.3g} {verdict(eq['no_sync_vs_large_batch'])}",
        f"  test accuracy after training: {tr['test_accuracy']:.1%}"
        + (f" (one process: {tr['test_accuracy_single_process']:.1%})"
           if tr["test_accuracy_single_process"] is not None else ""),
        "",
        f"Speed: median step time, slowest rank, {r['timing']['rounds']} interleaved rounds:",
    ]
    calls = why["allreduce_calls"]
    notes = {"local": "no communication: the floor",
             "naive": f"{calls['naive']} all-reduces per step, after backward",
             "bucketed": f"{calls['bucketed']} bucket(s), during backward",
             "native": f"{calls['native']} bucket(s), during backward"}
    for kind in variants:
        ratio = "" if kind == "native" else f"×{r['ratio_to_native'][kind]:.2f} native"
        lines.append(f"  {labels[kind]:<26} {r['step_time_ms'][kind]:7.1f} ms  {ratio:<13} "
                     f"{notes[kind]}")
    lines.append(f"  one tiny all-reduce takes {why['small_allreduce_ms']:.2f} ms; the whole "
                 f"{why['gradient_mib']:.1f} MiB gradient in one message "
                 f"{why['whole_gradient_allreduce_ms']:.1f} ms")
    mem = r["peak_memory_mb"]
    if mem:
        lines.append("Peak memory added per rank, setup | steady state (MiB): " + ", ".join(
            f"{labels[k]} {mem[k]['setup']:.0f} | {mem[k]['steady']:.0f}"
            for k in memory_variants))
    scaling = r["scaling"]
    if "points" in scaling:
        lines.append("Throughput (samples/s, native | bucketed): " + ", ".join(
            f"{p['world_size']} rank(s) {p['samples_per_s']['native']:.0f} | "
            f"{p['samples_per_s']['bucketed']:.0f}" for p in scaling["points"]))
    else:
        lines.append(f"Scaling sweep skipped: {scaling['skipped']}")
    return "\n".join(lines)
