"""What chapter 10's numbers say, computed from its results so that the page cannot say
otherwise: where the cost model is optimistic, how close the slow cable's busbw is to its cap,
whether a bucket outlasts backward on it, and how the projected curves compare."""

from __future__ import annotations

import math

RUN_NAMES = {"1x2_loopback": "1 × 2 loopback", "2x2_unshaped": "2 × 2 unshaped",
             "2x2_1gbit": "2 × 2 at 1 Gbit/s", "2x2_100mbit": "2 × 2 at 100 Mbit/s"}
BACKWARD_SHARE = 2 / 3  # the cost model's assumption (costmodel.step_time)


def verdicts(metrics: dict, rates_mbit: dict, bucket_bytes: float) -> dict:
    out = {"model": model_verdict(metrics["validation"]["runs"]),
           "projection": projection_verdict(metrics["projection"])}
    if metrics.get("two_node"):
        out["cable"] = cable_verdict(metrics["two_node"]["phases"], rates_mbit, bucket_bytes)
    return out


def words(names: list[str]) -> str:
    return ", ".join(RUN_NAMES.get(n, n) for n in names) if names else "none"


def model_verdict(runs: dict) -> dict:
    """Which runs the model predicts within 15 %, and on which it is optimistic (too fast)."""
    within = [n for n, r in runs.items() if r["rel_error"] <= 0.15]
    optimistic = [n for n, r in runs.items() if r["predicted_ms"] < r["measured_ms"]
                  and r["rel_error"] > 0.15]
    pessimistic = [n for n, r in runs.items() if r["predicted_ms"] > r["measured_ms"]
                   and r["rel_error"] > 0.15]
    return {"within_15_percent": words(within), "optimistic_beyond_15_percent": words(optimistic),
            "pessimistic_beyond_15_percent": words(pessimistic)}


def cable_verdict(phases: dict, rates_mbit: dict, bucket_bytes: float) -> dict:
    """Per shaped phase: measured busbw as a share of the cap, and how long one all-reduce of
    the measured size nearest a bucket took next to the backward pass (compute × the backward
    share)."""
    out = {}
    for phase, rate in rates_mbit.items():
        if rate is None or phase not in phases:
            continue
        m = phases[phase]
        nearest = min(m["allreduce_s"], key=lambda size: abs(math.log(float(size) / bucket_bytes)))
        backward_ms = m["compute_ms"] * BACKWARD_SHARE
        allreduce_ms = m["allreduce_s"][nearest] * 1e3
        out[phase] = {"busbw_share_of_cap": m["busbw_gbps"] / (rate * 1e6 / 8 / 1e9),
                      "allreduce_bytes": int(nearest), "allreduce_ms": allreduce_ms,
                      "backward_ms": backward_ms,
                      "allreduce_over_backward": allreduce_ms / backward_ms,
                      "allreduce_vs_backward": ("longer than" if allreduce_ms > backward_ms
                                                else "shorter than")}
    return out


def projection_verdict(curves: dict) -> dict:
    """The 1B and 7B curves against each other, and the book's model against them at the end."""
    out = {}
    for link in sorted({name.split("_", 1)[1] for name in curves}):
        big, bigger, book = (curves[f"{m}_{link}"]["efficiency"] for m in ("1B", "7B", "book"))
        gap = max(abs(a - b) for a, b in zip(big, bigger, strict=True))
        last_large = (big[-1] + bigger[-1]) / 2
        out[link] = {"max_gap_1B_7B": gap, "book_minus_large_at_end": book[-1] - last_large,
                     "book_vs_large_at_end": "above" if book[-1] > last_large else "below"}
    return out
