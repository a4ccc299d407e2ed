"""What chapter 10's numbers say, computed from its results so that the page cannot say
otherwise: where the cost model is optimistic, how close the slow cable's busbw is to its cap,
whether a bucket outlasts backward on it, and how the projected curves compare."""

from __future__ import annotations

import math

from .chapter10_report import LOSS_SIGNS

RUN_NAMES = {"1x2_loopback": "1 × 2 loopback", "2x2_unshaped": "2 × 2 unshaped",
             "2x2_1gbit": "2 × 2 at 1 Gbit/s", "2x2_100mbit": "2 × 2 at 100 Mbit/s"}
BACKWARD_SHARE = 2 / 3  # the cost model's assumption (costmodel.step_time)


def verdicts(metrics: dict, rates_mbit: dict, bucket_bytes: float) -> dict:
    out = {"model": model_verdict(metrics["validation"]["runs"]),
           "projection": projection_verdict(metrics["projection"]),
           "gamma_text": gamma_text(metrics["calibration"].get("gamma_s_per_byte"))}
    if metrics.get("two_node"):
        out["cable"] = cable_verdict(metrics["two_node"]["phases"], rates_mbit, bucket_bytes)
        out["heard"] = {how: heard(metrics["two_node"][how].get("node_a_heard"))
                        for how in ("failover", "power_cut") if how in metrics["two_node"]}
    return out


def heard(line: str | None) -> str:
    """The words in node a's error that say how it learnt of the loss."""
    return next((sign for sign in LOSS_SIGNS if sign in (line or "")),
                "no error line that names the loss")


def words(names: list[str]) -> str:
    return ", ".join(RUN_NAMES.get(n, n) for n in names) if names else "none"


def model_verdict(runs: dict) -> dict:
    """Which runs the model predicts within 15 %, and on which it is optimistic (too fast)."""
    within = [n for n, r in runs.items() if r["rel_error"] <= 0.15]
    optimistic = [n for n, r in runs.items() if r["predicted_ms"] < r["measured_ms"]
                  and r["rel_error"] > 0.15]
    pessimistic = [n for n, r in runs.items() if r["predicted_ms"] > r["measured_ms"]
                   and r["rel_error"] > 0.15]
    schedule_misses = [n for n, r in runs.items() if r["rel_error_own_allreduce"] > 0.15]
    largest = max(r["rel_error"] for r in runs.values())
    worst = [n for n, r in runs.items() if r["rel_error"] == largest]   # every run of a tie
    directions = {direction(runs[n]) for n in worst}
    return {"within_15_percent": words(within), "optimistic_beyond_15_percent": words(optimistic),
            "pessimistic_beyond_15_percent": words(pessimistic),
            "schedule_beyond_15_percent": words(schedule_misses),
            "most_off": words(worst), "most_off_rel_error": largest,
            "most_off_direction": (directions.pop() if len(directions) == 1
                                   else "optimistic on one, pessimistic on another")}


def direction(run: dict) -> str:
    """Whether the model predicted a faster step than measured, a slower one, or the same."""
    if run["predicted_ms"] < run["measured_ms"]:
        return "optimistic (a faster step than measured)"
    if run["predicted_ms"] > run["measured_ms"]:
        return "pessimistic (a slower step than measured)"
    return "exact"


def gamma_text(gamma_s_per_byte: float | None) -> str:
    """γ as the page states it; a calibration without one adds at no cost (ring_time's 0)."""
    if not gamma_s_per_byte:
        return ("no γ: the chapter 03 run it read recorded none, so the model counts "
                "adding as free")
    return f"γ from chapter 03: adding at {1e-9 / gamma_s_per_byte:.3g} GB/s"


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
                      "allreduce_vs_backward": compare(allreduce_ms, backward_ms)}
    return out


def compare(allreduce_ms: float, backward_ms: float) -> str:
    if allreduce_ms > backward_ms:
        return "longer than"
    return "shorter than" if allreduce_ms < backward_ms else "as long as"


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
