"""Chapter 03's summary: the correctness matrix in a few numbers, the stalls and the per-call
costs, issue 10's goals as measured, and the whole run on one screen (printed by the launching
process)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

IMPLS = ("ring", "native", "naive")  # the three all-reduces the chapter times
FULL_RUN_LARGEST = 64 << 20  # the 64 MiB goal is set for the full run's largest size


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
    """Issue 10's targets for the ring, as measured (a benchmark record, not a test)."""
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
    2(N-1)·α is paid once per call (Python, setting up the exchange, waking up to return)."""
    empty_call_ms = 2 * (world - 1) * fit["alpha_us"] * 1e-3
    per_message = segments["extra_ms_per_message"]
    fixed = empty_call_ms - 2 * (world - 1) * per_message if per_message is not None else None
    return {"empty_call_ms": empty_call_ms, "messages": 2 * (world - 1),
            "per_message_ms": per_message, "once_per_call_ms": fixed}


def summarize(metrics: dict, label_bytes: Callable[[int], str],
              bandwidth_text: Callable[[float | None], str]) -> str:
    """The run on one screen: correctness, the table by size, the fits and the goals
    (``label_bytes``, ``bandwidth_text``: the figures' own labels, so screen and figures agree)."""
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
KEEPS_PACE = 1.1  # naive keeps pace while its time is within 10 % of the ring's
NAMES = {"ring": "the ring", "native": "gloo", "naive": "the naive one"}


def join_words(words: list[str]) -> str:
    """["a"] -> "a"; ["a", "b", "c"] -> "a, b and c"."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + f" and {words[-1]}"


def runs_text(chosen: list[int], sizes: list[int], label: Callable[[int], str]) -> str:
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
        words += ([label(s) for s in run] if len(run) <= 2
                  else [f"{label(run[0])} to {label(run[-1])}"])
    return join_words(words)


def ring_against_gloo(m: dict, label: Callable[[int], str]) -> str:
    """Which bucket-sized tensors the ring's busbw trails gloo's at, as a clause."""
    ratio, sizes = m["ratio_ring_to_native_busbw"], m["sizes_bytes"]
    band = [s for s in sizes if BUCKET_SIZES[0] <= s <= BUCKET_SIZES[1]]
    trails = [s for s in band if ratio[str(s)] < TRAILS_BELOW]
    keeps = [s for s in band if s not in trails]
    if not band:
        return "this run measured no size between 1 and 25 MiB"
    if not trails:
        return ("the ring's bus bandwidth stayed within 10 % of gloo's or above it at every size "
                "from 1 to 25 MiB")
    clause = (f"the ring's bus bandwidth trailed gloo's by more than 10 % at "
              f"{runs_text(trails, band, label)}")
    if keeps:
        clause += f", and was within 10 % of it or above it at {runs_text(keeps, band, label)}"
    return clause


def naive_against_the_others(m: dict, label: Callable[[int], str]) -> dict:
    """Where the naive all-reduce was the fastest, and how far it kept pace with the ring."""
    sizes, t = m["sizes_bytes"], m["time_ms"]
    fastest = [s for s in sizes
               if t["naive"][str(s)] < min(t["ring"][str(s)], t["native"][str(s)])]
    behind = [s for s in sizes if t["naive"][str(s)] > KEEPS_PACE * t["ring"][str(s)]]
    first_behind = behind[0] if behind else None
    pace_up_to = (sizes[-1] if first_behind is None
                  else sizes[sizes.index(first_behind) - 1] if first_behind != sizes[0] else None)
    fastest_text = (f"was the fastest of the three at {runs_text(fastest, sizes, label)}"
                    if fastest else "was the fastest of the three at no size")
    if pace_up_to is None:
        pace = "was more than 10 % behind the ring at every size"
    else:
        pace = f"kept within 10 % of the ring's time up to {label(pace_up_to)}"
    if first_behind is not None and pace_up_to is not None:
        k = str(first_behind)
        pace += (f", and was more than 10 % behind it at {runs_text(behind, sizes, label)} "
                 f"(at {label(first_behind)}: {t['naive'][k]:.1f} ms against "
                 f"{t['ring'][k]:.1f} ms)")
    elif first_behind is None:
        pace += ", the largest size measured"
    return {"fastest_at": fastest, "fastest_text": fastest_text,
            "keeps_pace_up_to": pace_up_to, "first_behind": first_behind, "pace_text": pace}


def alpha_comparison(m: dict) -> dict:
    """The three fitted α, smallest first, and whether the naive all-reduce (Python
    send/recv/wait, like the ring) has a smaller one than gloo's C++ all-reduce."""
    alpha = {name: fit["alpha_us"] for name, fit in m["alpha_beta"].items()}
    order = sorted(alpha, key=alpha.get)
    names = {"ring": "the ring", "native": "gloo", "naive": "the naive all-reduce"}
    naive_below = alpha["naive"] < alpha["native"]
    return {"order_text": join_words([f"{names[n]} {alpha[n]:.0f} µs" for n in order]),
            "naive_below_gloo": naive_below,
            "python_text": ("so Python's calls alone do not make an α high: the naive "
                            "all-reduce makes them too, and its α is below gloo's"
                            if naive_below else
                            "the naive all-reduce, which makes Python calls too, has an α no "
                            "lower than gloo's in this run")}


def stall_order(m: dict) -> str:
    """The three implementations by their share of stalled rounds, most first."""
    stalls = m["stalls"]
    order = sorted(stalls, key=lambda n: -stalls[n]["share"])
    return join_words([f"{NAMES[n]} in {stalls[n]['share']:.0%} of its rounds" for n in order])


def verdicts(m: dict, label: Callable[[int], str]) -> dict:
    """Every comparison the page draws from this run, computed (values and the phrases the
    page renders), so that a run that measures otherwise changes the sentence with it."""
    beta = {name: m["alpha_beta"][name]["beta_gbps"] or 0.0 for name in ("naive", "ring")}
    return {"ring_against_gloo_in_buckets": ring_against_gloo(m, label),
            "naive": naive_against_the_others(m, label),
            "naive_link": ("as if its link were faster, which no real link would be"
                           if beta["naive"] > beta["ring"] else
                           "no faster than the ring's: in this run the fit does not show it"),
            "alpha": alpha_comparison(m),
            "stall_order": stall_order(m)}
