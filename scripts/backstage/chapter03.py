"""Chapter 03's summary: the correctness matrix in a few numbers, the stalls and the per-call
costs, the chapter's goals as measured, and the whole run on one screen (printed by the launching
process)."""

from __future__ import annotations

import statistics

IMPLS = ("ring", "native", "naive")  # the three all-reduces the chapter times
FULL_RUN_LARGEST = 64 << 20  # the 64 MiB goal is set for the full run's largest size
KiB, MiB = 1 << 10, 1 << 20


def label_bytes(n: int) -> str:
    """A size as the chapter writes it everywhere (screen, results.json, figures): 4 KiB."""
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def bandwidth_text(gbps: float | None) -> str:
    """A fitted bandwidth, or why there is none."""
    return f"{gbps:.2f} GB/s" if gbps is not None else "unseen (sizes too small)"


def correctness_summary(rows: list[dict], world: int) -> dict:
    """The correctness matrix in a few numbers (and the texts the page quotes)."""
    floats = [r for r in rows if r["dtype"] != "int64"]
    sizes, dtypes = sorted({r["size"] for r in rows}), sorted({r["dtype"] for r in rows})
    bitwise = all(r["bitwise_equal"] for r in floats)
    return {
        "checks": len(rows),
        "passed": sum(r["within_bound"] for r in rows),
        "sizes": sizes,
        "dtypes": dtypes,
        "sizes_text": ", ".join(map(str, sizes[:-1])) + f" and {sizes[-1]:,}",  # for the page
        "dtypes_text": ", ".join(dtypes),
        "floats_text": "bitwise identical" if bitwise else "within the bound, not bitwise equal",
        "integers_exact": all(r["bitwise_equal"] for r in rows if r["dtype"] == "int64"),
        "floats_bitwise_equal": all(r["bitwise_equal"] for r in floats),
        "max_abs_diff_float32": max(r["max_abs_diff"] for r in floats if r["dtype"] == "float32"),
        "failures": [r for r in rows if not r["within_bound"]],
        "world_size": world,
    }


def goals(m: dict) -> dict:
    """The ring's targets against native, as measured (a benchmark record, not a test)."""
    at_1mib = m["ratio_ring_to_native_busbw"].get(str(1 << 20))
    rows = {"latency_ratio_smallest": (m["smallest"]["ratio_ring_to_native_time"], "<=", 1.5),
            "busbw_ratio_1mib": (at_1mib, ">=", 0.8),
            "busbw_ratio_largest": (m["largest"]["ratio_ring_to_native_busbw"], ">=", 1.0)}
    for name in ("ring", "native"):
        fit = m["alpha_beta"][name]
        rows[f"r2_{name}"] = (fit["r2"], ">=", 0.95)
        rows[f"max_rel_err_{name}"] = (fit["max_rel_err"], "<=", 0.25)
    met = lambda v, op, lim: v is not None and (v <= lim if op == "<=" else v >= lim)  # noqa: E731
    judged = {k: {"value": v, "target": f"{op} {lim}", "met": met(v, op, lim)}
              for k, (v, op, lim) in rows.items()}
    if m["largest"]["size_bytes"] < FULL_RUN_LARGEST:  # --quick stops at 16 MiB
        judged["busbw_ratio_largest"] |= {"target": ">= 1.0 at 64 MiB (the full run)",
                                          "met": None}
    return judged


def stall_summary(sizes: list[int], result: dict) -> dict:
    """Up to 1 MiB, where a stall weighs most: per implementation, the share of rounds that
    stalled (over all those sizes), the most at one size, and a stall's median extra time."""
    small = [i for i, size in enumerate(sizes) if size <= 1 << 20]
    summary = {}
    for name, shares in result["stalled"].items():
        extra = [result["stall_ms"][name][i] for i in small if shares[i] > 0]
        summary[name] = {"share": statistics.mean(shares[i] for i in small),
                         "most": max(shares[i] for i in small),
                         "extra_ms": statistics.median(extra) if extra else None}
    return summary


def per_call_costs(fit: dict, segments: dict, world: int) -> dict:
    """The fit's α lumps every fixed cost into one number per message: 2(N-1)·α is the time
    of an empty call.  The segment sweep measures what one *extra* message costs; the rest of
    2(N-1)·α would be paid once per call (Python, setting up the exchange, waking up to
    return).  A rest below zero (a sweep's message dearer than a small call's) is no cost:
    ``once_per_call_ms`` is then None and ``rest_ms`` keeps the difference."""
    empty_call_ms = 2 * (world - 1) * fit["alpha_us"] * 1e-3
    per_message = segments["extra_ms_per_message"]
    rest = empty_call_ms - 2 * (world - 1) * per_message if per_message is not None else None
    return {"empty_call_ms": empty_call_ms, "messages": 2 * (world - 1),
            "per_message_ms": per_message, "rest_ms": rest,
            "once_per_call_ms": rest if rest is not None and rest >= 0 else None}


def summarize(metrics: dict) -> str:
    """The run on one screen: correctness, the table by size, the fits and the goals (in the
    figures' words: ``label_bytes``, ``bandwidth_text``)."""
    c = metrics["correctness"]
    lines = [f"correct: {metrics['correct']} ({c['passed']}/{c['checks']} checks, sizes "
             f"{c['sizes']}, {', '.join(c['dtypes'])})"]
    one_rank = "one_rank" in metrics
    lines.append("size        ring ms  native ms  naive ms" +
                 ("" if one_rank else "   busbw ring/native/naive GB/s   ring/native"))
    for s in metrics["sizes_bytes"]:
        t = {n: metrics["time_ms"][n][str(s)] for n in IMPLS}
        b = {n: metrics["busbw_gbps"][n][str(s)] for n in IMPLS}
        line = f"{label_bytes(s):>8}  {t['ring']:8.3f}  {t['native']:9.3f}  {t['naive']:8.3f}"
        if not one_rank:
            line += (f"   {b['ring']:5.2f} / {b['native']:5.2f} / {b['naive']:5.2f}   "
                     f"{metrics['ratio_ring_to_native_busbw'][str(s)]:10.2f}")
        lines.append(line)
    if one_rank:
        lines.append(metrics["one_rank"])
    for name, fit in metrics["alpha_beta"].items():
        errors = " ".join(f"{e:+.0%}" for e in fit["rel_err"].values())
        lines.append(f"alpha-beta-gamma {name:>6}: alpha = {fit['alpha_us']:.1f} us, "
                     f"1/beta = {bandwidth_text(fit['beta_gbps'])}, weighted R^2 = "
                     f"{fit['r2']:.3f}; model vs measured by size: {errors}")
    lines.append(f"1/gamma (adding, measured alone) = {metrics['gamma_gbps']:.2f} GB/s; "
                 f"size check (ring_all_reduce(check=True) only): "
                 f"{metrics['size_check_us']:.0f} us per call")
    for name, goal in metrics.get("goals", {}).items():
        value = "n/a" if goal["value"] is None else f"{goal['value']:.3f}"
        verdict = {True: "met", False: "NOT met", None: "not judged here"}[goal["met"]]
        lines.append(f"goal {name:<24} {value:>7} (target {goal['target']}): {verdict}")
    return "\n".join(lines)


# --- verdicts: the page's comparisons, computed from the run --------------------------------------

MiB = 1 << 20
BUCKET_SIZES = (1 * MiB, 25 * MiB)  # where DDP's buckets live (1 MiB first bucket, 25 MiB cap)
TRAILS_BELOW = 0.9  # a busbw ratio below this: the ring more than 10 % behind gloo
NAMES = {"ring": "the ring", "native": "gloo", "naive": "the naive one"}


def join_words(words: list[str]) -> str:
    """["a"] -> "a"; ["a", "b", "c"] -> "a, b and c"."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + f" and {words[-1]}"


def runs_text(chosen: list[int], sizes: list[int]) -> str:
    """The chosen sizes as runs of neighbours in ``sizes``: "4 KiB to 2 MiB and 8 MiB"."""
    runs: list[list[int]] = []
    for i, size in enumerate(sizes):
        if size not in chosen:
            continue
        if runs and sizes.index(runs[-1][-1]) == i - 1:
            runs[-1].append(size)
        else:
            runs.append([size])
    words = []
    for run in runs:  # two neighbours read better as "1 MiB and 2 MiB"
        words += ([label_bytes(s) for s in run] if len(run) <= 2
                  else [f"{label_bytes(run[0])} to {label_bytes(run[-1])}"])
    return join_words(words)


def ring_against_gloo(m: dict) -> str:
    """How the ring's busbw compared with gloo's on bucket-sized tensors, as a plain clause:
    "more than 10 % slower than gloo below 16 MiB, and as fast or faster from 16 MiB up"."""
    ratio, sizes = m["ratio_ring_to_native_busbw"], m["sizes_bytes"]
    band = [s for s in sizes if BUCKET_SIZES[0] <= s <= BUCKET_SIZES[1]]
    if not band:
        return "this run measured no size between 1 and 25 MiB"
    trails = [ratio[str(s)] < TRAILS_BELOW for s in band]
    slower, as_fast = "more than 10 % slower than gloo", "as fast as gloo or faster"
    if all(trails) or not any(trails):
        return f"the ring was {slower if all(trails) else as_fast} at every size"
    switches = [i for i in range(1, len(band)) if trails[i] != trails[i - 1]]
    if len(switches) == 1:  # one threshold: say it as one
        first, then = (slower, "as fast or faster") if trails[0] else (as_fast, slower)
        edge = label_bytes(band[switches[0]])
        return f"the ring was {first} below {edge}, and {then} from {edge} up"
    behind = [s for s, slow in zip(band, trails, strict=True) if slow]
    level = [s for s in band if s not in behind]
    return (f"the ring was {slower} at {runs_text(behind, band)}, and as fast or faster "
            f"at {runs_text(level, band)}")


def same_at_print(ratio: float) -> bool:
    """A ratio that prints as 1.00: a tie at the page's precision."""
    return f"{ratio:.2f}" == "1.00"


def ratio_span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.2f}×" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}× to {high:.2f}×"


def naive_against_the_others(m: dict) -> dict:
    """Where the naive all-reduce was the fastest of the three, and where it was faster than,
    as fast as (a time ratio that prints as 1.00) or slower than the ring, with the range of its
    time over the ring's at those sizes."""
    sizes, t = m["sizes_bytes"], m["time_ms"]
    fastest = [s for s in sizes
               if t["naive"][str(s)] < min(t["ring"][str(s)], t["native"][str(s)])]
    ratio = {s: t["naive"][str(s)] / t["ring"][str(s)] for s in sizes}
    tied = [s for s in sizes if same_at_print(ratio[s])]
    faster = [s for s in sizes if ratio[s] < 1 and s not in tied]
    slower = [s for s in sizes if ratio[s] > 1 and s not in tied]
    fastest_text = (f"was the fastest of the three at {runs_text(fastest, sizes)}"
                    if fastest else "was the fastest of the three at no size")

    def side(word: str, chosen: list[int]) -> str:
        return (f"{word} the ring at {runs_text(chosen, sizes)} "
                f"({ratio_span([ratio[s] for s in chosen])} its time)")

    sides = [side(word, chosen) for word, chosen in (("faster than", faster),
                                                     ("as fast as", tied),
                                                     ("slower than", slower)) if chosen]
    pace = "was " + join_words(sides)
    return {"fastest_at": fastest, "fastest_text": fastest_text, "faster_at": faster,
            "tied_at": tied, "slower_at": slower, "pace_text": pace}


def alpha_comparison(m: dict) -> dict:
    """The three fitted α, smallest first, and whether the naive all-reduce (Python
    send/recv/wait, like the ring) has a smaller one than gloo's C++ all-reduce: only then do
    its numbers rebut "Python makes the ring's α high"."""
    alpha = {name: fit["alpha_us"] for name, fit in m["alpha_beta"].items()}
    order = sorted(alpha, key=alpha.get)
    names = {"ring": "the ring", "native": "gloo", "naive": "the naive all-reduce"}
    naive_below = alpha["naive"] < alpha["native"] and f"{alpha['naive']:.0f}" != \
        f"{alpha['native']:.0f}"
    python_text = ("It is tempting to blame Python for the ring's, but the naive all-reduce is "
                   "Python `send`, `recv` and `wait` as well, and its α is below gloo's: "
                   "Python's calls alone do not make an α high"
                   if naive_below else
                   "The naive all-reduce, Python `send`, `recv` and `wait` like the ring, has "
                   "an α no lower than gloo's in this run, so this run cannot tell Python's "
                   "share of the ring's α")
    return {"order_text": join_words([f"{names[n]} {alpha[n]:.0f} µs" for n in order]),
            "smallest_text": SMALLEST_ALPHA_BECAUSE[order[0]],
            "naive_below_gloo": naive_below, "python_text": python_text}


SMALLEST_ALPHA_BECAUSE = {  # why the all-reduce with the smallest fitted α has it, in one line
    "naive": ("The simplest one has the smallest fixed cost, and it does the least per call: "
              "its ranks send and receive whole tensors, while gloo's ring cuts every chunk into "
              "at least two segments (more messages per call) and the book's ring does more "
              "Python bookkeeping per call to keep its messages flowing (the last section)"),
    "native": "gloo, whose whole call runs in C++, has the smallest fixed cost in this run",
    "ring": ("The ring has the smallest fixed cost in this run, though it makes as many messages "
             "per call as the naive one; this run does not measure why"),
}


def stall_order(m: dict) -> str:
    """The three implementations by their share of stalled rounds, most first."""
    stalls = m["stalls"]
    order = sorted(stalls, key=lambda n: -stalls[n]["share"])
    return join_words([f"{NAMES[n]} in {stalls[n]['share']:.0%} of its rounds" for n in order])


def alpha_gap_to_naive(m: dict) -> dict:
    """The ring's fixed cost per call above the naive all-reduce's, from the fitted α
    (2(N-1) messages each).  The run does not split it: the segment sweep says what one more
    message costs the ring in a large call, not in a small one, and nothing times what the
    naive one pays once per call (an inbox allocated, the peers listed, on every call)."""
    messages = m["per_call"]["messages"]
    alpha = {name: m["alpha_beta"][name]["alpha_us"] for name in ("ring", "naive")}
    gap_ms = messages * (alpha["ring"] - alpha["naive"]) * 1e-3
    if f"{gap_ms:.3f}" in ("0.000", "-0.000") or gap_ms < 0:
        return {"gap_ms": gap_ms,
                "text": (f"the ring's fitted fixed cost per call is not above the naive one's in "
                         f"this run ({gap_ms:+.3f} ms), so there is no gap to explain")}
    return {"gap_ms": gap_ms,
            "text": (f"per call, the ring's fitted fixed cost is {gap_ms:.3f} ms above the "
                     f"naive one's ({messages} × the difference of their α). This run does not "
                     f"split that: it times neither what the naive version pays once per call "
                     f"(it allocates an inbox and lists its peers on every call) nor what one "
                     f"message costs in a call this small")}


def once_per_call(m: dict) -> str:
    """What the segment sweep leaves of an empty call's fixed cost, as a clause."""
    pc, seg = m["per_call"], m["segments"]
    if pc["per_message_ms"] is None:
        return "this run's segment sweep measured no cost per message, so it does not split it"
    smallest = min((r for r in seg["rows"] if r["segment_bytes"]),
                   key=lambda r: r["segment_bytes"])
    where = (f"the sweep ({smallest['segment_label']} against {seg['default_segment']} "
             f"segments, of a {seg['size_label']} tensor)")
    if pc["once_per_call_ms"] is None:
        return (f"{pc['messages']} such messages cost more than the whole empty call "
                f"({pc['rest_ms']:+.3f} ms left), so a message costs less in a small call than "
                f"in {where}, and this run does not split the empty call")
    return (f"that leaves {pc['once_per_call_ms']:.3f} ms of the empty call paid once per call — "
            f"if a message in a small call costs as much as in {where}, which this run does not "
            f"check")


def busbw_below_gloo(m: dict) -> tuple[list[int], str]:
    """The sizes where the ring's bus bandwidth was below gloo's (a ratio that prints below
    1.00), with the range of the ratio there, as a clause."""
    ratio, sizes = m["ratio_ring_to_native_busbw"], m["sizes_bytes"]
    below = [s for s in sizes if ratio[str(s)] < 1 and not same_at_print(ratio[str(s)])]
    if not below:
        return below, "the ring's bus bandwidth was below gloo's at no size"
    return below, (f"the ring's bus bandwidth was below gloo's at {runs_text(below, sizes)}"
                   f" ({ratio_span([ratio[str(s)] for s in below])} of it)")


def bandwidth_gap(m: dict) -> dict:
    """The two fitted 1/β against what was measured: the sizes where the ring's bus bandwidth
    was below gloo's, and the largest size, where the fits' bandwidth terms weigh most.  No
    share of a gap is claimed: the run times what one more message costs the ring, not what
    one costs gloo, whose ring sends its own segments (gloo/allreduce.h: at most
    kMaxSegmentSize, 1 MiB, each)."""
    beta = {name: m["alpha_beta"][name]["beta_gbps"] for name in ("ring", "native")}
    if not beta["ring"] or not beta["native"]:
        return {"text": "this run fitted no bandwidth term to compare"}
    ratio = beta["native"] / beta["ring"]
    fitted = ("the two fitted 1/β are the same" if same_at_print(ratio) else
              f"gloo's fitted 1/β is {ratio:.2f}× the ring's" if ratio > 1 else
              f"the ring's fitted 1/β is {1 / ratio:.2f}× gloo's")
    below, measured = busbw_below_gloo(m)
    largest = m["largest"]["size_bytes"]
    size = label_bytes(largest)
    times = {name: m["time_ms"][name][str(largest)] for name in ("ring", "native")}
    errors = {name: m["alpha_beta"][name]["rel_err"][str(largest)] for name in times}
    at_largest = times["native"] / times["ring"]
    verb = ("as fast as" if same_at_print(at_largest) else
            "faster than" if at_largest > 1 else "slower than")
    text = (f"{fitted}. Measured, {measured}. At {size}, where the bandwidth terms weigh most, "
            f"the ring was {verb} gloo ({times['ring']:.1f} against {times['native']:.1f} ms)")
    fit_says_ring_slower = ratio > 1 and not same_at_print(ratio)
    if fit_says_ring_slower and verb != "slower than":
        text += (f", so there the fitted difference is not a measured one: gloo's model is off "
                 f"by {errors['native']:+.0%} at {size} and the ring's by {errors['ring']:+.0%}, "
                 f"each 1/β being set by all the sizes the fit weighs together")
    if below:
        text += (". This run does not split the measured gap: it times what one more message "
                 "costs the ring, but not what one costs gloo, whose ring sends segments of at "
                 "most 1 MiB")
    return {"ratio": ratio, "below_at": below, "ring_at_largest": verb,
            "fit_errors_largest": errors, "text": text}


def best_segment(m: dict) -> dict:
    """The fastest segment size of the sweep, how much longer its neighbours took, and the
    run's own noise: the default segment in the sweep against the same configuration in the
    benchmark (same size, same segment, timed at another moment)."""
    seg = m["segments"]
    rows = [r for r in seg["rows"] if r["segment_bytes"] is not None]
    best = min(range(len(rows)), key=lambda i: rows[i]["time_ms"])
    base = rows[best]["time_ms"]
    neighbours = [rows[i] for i in (best - 1, best + 1) if 0 <= i < len(rows)]
    excess = {r["segment_label"]: r["time_ms"] / base - 1 for r in neighbours}
    default = next((r for r in rows if r["segment_label"] == seg["default_segment"]), None)
    if default is None:
        return {"best": rows[best]["segment_label"],
                "text": f"the fastest in this run was {rows[best]['segment_label']}"}
    bench = m["time_ms"]["ring"][str(seg["size_bytes"])]
    noise = abs(default["time_ms"] - bench) / min(default["time_ms"], bench)
    beyond = [label for label, e in excess.items() if e > noise]
    neighbour_text = ("its neighbours took " if len(excess) > 1 else "its neighbour took ") + \
        join_words([f"{label} {e:+.0%}" for label, e in excess.items()])
    verdict = ("larger than that noise"
               if len(beyond) == len(excess) else
               "within that noise, so this run does not tell which of them is best"
               if not beyond else
               f"larger than that noise only for {join_words(beyond)}")
    return {"best": rows[best]["segment_label"], "best_ms": base, "neighbours": excess,
            "noise": noise,
            "text": (f"the fastest in this run was {rows[best]['segment_label']} "
                     f"({base:.1f} ms); {neighbour_text}. The same default "
                     f"configuration ({seg['default_segment']} segments, "
                     f"{seg['size_label']}) took {default['time_ms']:.1f} ms in this sweep and "
                     f"{bench:.1f} ms in the benchmark, {noise:.0%} apart; the differences to "
                     f"{'its neighbours' if len(excess) > 1 else 'it'} are {verdict}")}


def size_check_cost(m: dict) -> str:
    """The size check against gloo's smallest all-reduce, and what in the check costs it: its
    own all-reduce of four integers (timed in the same rounds) and the Python around it."""
    check, alone = m["size_check_us"], m.get("size_check_all_reduce_us")
    small = m["smallest"]
    gloo_us = small["time_ms"]["native"] * 1e3
    text = (f"{check / gloo_us:.1f}× gloo's whole {small['size_kib']:.0f} KiB all-reduce "
            f"({gloo_us:.0f} µs in the benchmark, timed at another moment)")
    if alone is None:
        return text + "; this run did not time the check's own all-reduce alone, so it does " \
                      "not say what in the check costs that"
    python = check - alone
    if python <= 0:
        return text + (f"; its own all-reduce of four integers, timed in the same rounds, took "
                       f"all of it ({alone:.0f} µs)")
    return text + (f"; its own all-reduce of four integers, timed in the same rounds, took "
                   f"{alone:.0f} µs, and the Python around it (making the tensor, reading the "
                   f"result back with `.tolist()`) the other {python:.0f} µs "
                   f"({python / check:.0%})")


def verdicts(m: dict) -> dict:
    """Every comparison the page draws from this run, computed (values and the phrases the
    page renders), so that a run that measures otherwise changes the sentence with it."""
    beta = {name: m["alpha_beta"][name]["beta_gbps"] or 0.0 for name in ("naive", "ring")}
    return {"ring_against_gloo_in_buckets": ring_against_gloo(m),
            "naive": naive_against_the_others(m),
            "naive_link": ("as if its link were faster, which no real link would be"
                           if beta["naive"] > beta["ring"] else
                           "no faster than the ring's: in this run the fit does not show it"),
            "alpha": alpha_comparison(m),
            "alpha_gap_to_naive": alpha_gap_to_naive(m),
            "bandwidth_gap": bandwidth_gap(m),
            "once_per_call": once_per_call(m),
            "best_segment": best_segment(m),
            "size_check": size_check_cost(m),
            "stall_order": stall_order(m)}
