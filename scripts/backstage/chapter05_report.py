"""Chapter 05's summary: its results.json on one screen, read by the launching process.

Equivalence (max |Δ parameter| of each variant against native DDP, with a verdict), speed
(median step times and why NaiveDDP is slower), peak memory, and the throughput sweep; and
``memory_results``, the peak-memory part of results.json.
"""

from __future__ import annotations

LABELS = {"local": "local (no communication)", "naive": "NaiveDDP", "bucketed": "BucketedDDP",
          "native": "native DDP", "single": "one process, global batch",
          "no_sync": "BucketedDDP + no_sync",
          "native_view": "native DDP, gradient_as_bucket_view"}  # on screen and in the figures


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


def summarize(r: dict, prov: dict, variants: tuple, memory_variants: tuple) -> str:
    """The chapter's results on one screen."""
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
        lines.append(f"  {LABELS[kind]:<26} {r['step_time_ms'][kind]:7.1f} ms  {ratio:<13} "
                     f"{notes[kind]}")
    lines.append(f"  one tiny all-reduce takes {why['small_allreduce_ms']:.2f} ms; the whole "
                 f"{why['gradient_mib']:.1f} MiB gradient in one message "
                 f"{why['whole_gradient_allreduce_ms']:.1f} ms")
    mem = r["peak_memory_mb"]
    if mem:
        lines.append("Peak memory added per rank, setup | steady state (MiB): " + ", ".join(
            f"{LABELS[k]} {mem[k]['setup']:.0f} | {mem[k]['steady']:.0f}"
            for k in memory_variants))
    scaling = r["scaling"]
    if "points" in scaling:
        lines.append("Throughput (samples/s, native | bucketed): " + ", ".join(
            f"{p['world_size']} rank(s) {p['samples_per_s']['native']:.0f} | "
            f"{p['samples_per_s']['bucketed']:.0f}" for p in scaling["points"]))
    else:
        lines.append(f"Scaling sweep skipped: {scaling['skipped']}")
    return "\n".join(lines)


# --- verdicts: the page's comparisons, computed from the run --------------------------------------

def gap_to_native(r: dict, overlap: dict) -> dict:
    """How much of NaiveDDP's extra step time over native DDP the two named causes explain.

    The bytes are no cause: both send the whole gradient.  Messages: the fixed cost of each
    all-reduce NaiveDDP makes beyond native's, a lone tiny all-reduce each (by its median).
    No overlap: how far native DDP's step came in below its serial estimate (``overlap_worth``),
    signed.  That estimate leaves out native's copies into and out of its buckets, which
    NaiveDDP does not make either, so the difference is overlap's saving net of those copies,
    the very term by which native's step differs from NaiveDDP's beyond the messages.  Stalls,
    apart: the same extra calls by the lone all-reduce's mean instead of its median.  What is
    left this run does not attribute."""
    why, t = r["why_naive_is_slower"], r["step_time_ms"]
    extra_calls = why["allreduce_calls"]["naive"] - why["allreduce_calls"]["native"]
    gap = t["naive"] - t["native"]
    messages = extra_calls * why["small_allreduce_ms"]
    below_serial = overlap["serial_step_ms"] - overlap["native_step_ms"]
    explained = messages + below_serial
    mean = why.get("small_allreduce_mean_ms")  # a run from before it was recorded has none
    stalls = extra_calls * (mean - why["small_allreduce_ms"]) if mean is not None else None
    left = gap - explained - (stalls or 0.0)
    parts = {"gap": gap, "explained": explained, "messages": messages,
             "below_serial": below_serial, "stalls": stalls, "left": left}
    return {"gap_ms": gap, "extra_calls": extra_calls, "messages_ms": messages,
            "below_serial_ms": below_serial, "explained_ms": explained,
            "explained_share": explained / gap if gap > 0 else None, "stalls_ms": stalls,
            "unexplained_ms": left, "unexplained_share": left / gap if gap > 0 else None,
            "headline": gap_headline(gap, explained), "text": gap_text(parts, extra_calls)}


def gap_headline(gap: float, explained: float) -> str:
    """How much of the gap the two named causes explain, as one plain sentence."""
    if gap <= 0:
        return ("In this run NaiveDDP's step was not longer than native DDP's, so there is no "
                "gap to explain")
    if explained <= 0:
        return f"In this run the two explain none of NaiveDDP's {gap:.1f} ms gap"
    if explained >= gap:
        return f"In this run the two account for all of NaiveDDP's {gap:.1f} ms gap"
    return (f"In this run the two explain {explained:.1f} ms of NaiveDDP's {gap:.1f} ms gap "
            f"({explained / gap:.0%}); the note below says what is known of the rest")


def gap_text(ms: dict, extra_calls: int) -> str:
    """The gap's accounting as a clause; a gap that is not positive has nothing to explain."""
    gap = ms["gap"]
    if gap <= 0:
        return (f"in this run NaiveDDP's step was not longer than native DDP's "
                f"({gap:+.1f} ms), so there is no gap to explain")
    share = (f"explain none of it (together {ms['explained']:+.1f} ms)"
             if ms["explained"] <= 0 else
             f"account for all of it and more ({ms['explained']:.1f} ms)"
             if ms["explained"] >= gap else
             f"explain {ms['explained']:.1f} ms ({ms['explained'] / gap:.0%})")
    text = (f"of the {gap:.1f} ms by which NaiveDDP's step was longer, the two named causes "
            f"{share}: "
            f"{ms['messages']:.1f} ms for its {extra_calls} extra messages and "
            f"{ms['below_serial']:+.1f} ms for overlap (native DDP's serial estimate minus its "
            f"step: overlap's saving, net of native's copies into and out of its buckets, "
            f"which NaiveDDP does not make)")
    text += (". This run did not time the stalls that lone all-reduces meet"
             if ms["stalls"] is None else
             f". The stalls that lone all-reduces met on this machine (their mean instead of "
             f"their median) would add {ms['stalls']:.1f} ms")
    if ms["left"] > 0:
        return text + f"; the other {ms['left']:.1f} ms ({ms['left'] / gap:.0%}) this run " \
                      f"does not attribute"
    return text + ", more than the rest of the gap"


def overlap_worth(r: dict) -> dict:
    """Native DDP's step against the step it would take without overlap: the local step plus
    its bucket all-reduces one after another (the whole gradient in one message, plus the fixed
    cost of each further bucket).  The estimate leaves out native's copies into and out of its
    buckets, so it is low, and what overlap saved is, if anything, more than it shows."""
    why, t = r["why_naive_is_slower"], r["step_time_ms"]
    buckets = why["allreduce_calls"]["native"]
    serial = (t["local"] + why["whole_gradient_allreduce_ms"]
              + (buckets - 1) * why["small_allreduce_ms"])
    ratio = serial / t["native"]
    copies = ("this estimate leaves out native DDP's copies of the gradients into and out of "
              "its buckets, which this run does not time")
    text = (f"overlap saved at least {1 - 1 / ratio:.0%} of that step ({copies}, so the "
            f"saving can only be larger)" if ratio > 1 and f"{ratio:.2f}" != "1.00" else
            f"this estimate shows no saving from overlap: the step took {1 / ratio:.2f}× it. "
            f"But {copies}: overlap may have saved up to what they cost")
    return {"serial_step_ms": serial, "native_step_ms": t["native"], "ratio": ratio,
            "text": text}


def scaling_change(scaling: dict, before: int, after: int, kind: str = "native") -> dict:
    """The throughput change from ``before`` to ``after`` ranks, signed, and a phrase for it."""
    points = {p["world_size"]: p["samples_per_s"][kind] for p in scaling.get("points", [])}
    if before not in points or after not in points:
        return {"text": f"this run has no {before}- and {after}-rank points to compare (the "
                        f"sweep was skipped)"}
    change = points[after] / points[before] - 1
    verb = "gain" if change >= 0 else "lose"
    return {"before": points[before], "after": points[after], "change": change,
            "ratio": points[after] / points[before],
            "text": f"{after} ranks {verb} {abs(change):.0%} against {before}"}


def scaling_without_communication(scaling: dict) -> dict:
    """Each world size's throughput without communication against one rank's and against what
    the processors allow (on a CPU, one thread a rank: at most min(ranks, cores) times one
    rank; one GPU a rank: ranks times), and what native DDP's communication then cost.  Why
    the local runs fall short, the run does not measure."""
    points = {p["world_size"]: p["samples_per_s"] for p in scaling.get("points", [])}
    if 1 not in points or len(points) < 2:
        return {"text": "this run has no scaling sweep to read (it was skipped)"}
    cores = scaling["cpu_count"] if scaling.get("threads_per_rank") == 1 else None
    rows = []
    for ranks in sorted(k for k in points if k > 1):
        speedup = points[ranks]["local"] / points[1]["local"]
        allowed = min(ranks, cores) if cores else ranks
        rows.append({"world_size": ranks, "local_speedup": speedup, "allowed": allowed,
                     "short_of_allowed": 1 - speedup / allowed,
                     "communication_cost": 1 - points[ranks]["native"] / points[ranks]["local"]})
    local = join_words([f"{row['world_size']} ranks" for row in rows])
    local += " reached " + join_words([f"{row['local_speedup']:.2f}×" for row in rows])
    allowed = join_words(sorted({f"{row['allowed']}×" for row in rows}))
    limit = (f"{cores} cores allow at most {allowed}" if cores else
             f"one GPU a rank allows {allowed}")
    short = [row for row in rows if row["short_of_allowed"] > 0.1]
    shortfalls = [f"{row['short_of_allowed']:.0%} at {row['world_size']} ranks" for row in short]
    unexplained = (f": {join_words(shortfalls)} short of it, which this run does not explain "
                   f"(it measures neither other load on the machine nor memory bandwidth)"
                   if short else ": within 10 % of it")
    with_ddp = join_words([f"{1 - row['communication_cost']:.2f}× ({row['world_size']} ranks)"
                           for row in rows])
    return {"rows": rows,
            "text": (f"without communication ({'one thread' if cores else 'one GPU'} a rank), "
                     f"{local} the throughput of one rank, where {limit}{unexplained}. "
                     f"With native DDP's communication, the throughput was {with_ddp} "
                     f"of that without it")}


def join_words(words: list[str]) -> str:
    """["a"] -> "a"; ["a", "b", "c"] -> "a, b and c"."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + f" and {words[-1]}"


def verdicts(r: dict) -> dict:
    """Every comparison page 05 draws from this run, computed, so a run that measures
    otherwise changes the sentence with it."""
    overlap = overlap_worth(r)
    return {"gap_to_native": gap_to_native(r, overlap), "overlap": overlap,
            "scaling_1_to_2": scaling_change(r["scaling"], 1, 2),
            "scaling_2_to_4": scaling_change(r["scaling"], 2, 4),
            "scaling_without_communication": scaling_without_communication(r["scaling"])}
