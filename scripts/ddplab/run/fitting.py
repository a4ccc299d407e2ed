"""Least squares for a cost model: coefficients that cannot be negative, judged by relative error.

Chapter 03 fits t = 2(N-1)·α + sent·S·β (+ a known γ term) to all-reduce times from 4 KiB to
64 MiB.  Two things make a plain ``np.linalg.lstsq`` the wrong tool: times span four orders of
magnitude (so the chapter weights each point by 1/t, and R² must be the weighted one), and a
time per message or per byte is never negative (noisy small sizes can pull a free fit below 0).
"""

from __future__ import annotations

import numpy as np


def weighted_r2(t: np.ndarray, predicted: np.ndarray, w: np.ndarray) -> float:
    """R² of the weighted fit: 1 - (weighted residuals)² / (weighted spread around the weighted
    mean).  With w = 1/t it judges relative error, so every size counts, not only the largest."""
    mean = np.sum(w**2 * t) / np.sum(w**2)
    return float(1 - np.sum((w * (t - predicted)) ** 2) / np.sum((w * (t - mean)) ** 2))


def non_negative_lstsq(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Least squares for two coefficients that cannot be negative (a time per message, a time
    per byte).  Noisy latency-bound points can pull the free fit below zero; then the best fit
    keeps one term and sets the other to zero."""
    free, *_ = np.linalg.lstsq(a, b, rcond=None)
    if (free >= 0).all():
        return float(free[0]), float(free[1])
    candidates = []
    for keep in (0, 1):
        coef = np.zeros(2)
        coef[keep] = max(float(a[:, keep] @ b) / float(a[:, keep] @ a[:, keep]), 0.0)
        candidates.append((float(np.sum((a @ coef - b) ** 2)), coef))
    best = min(candidates, key=lambda c: c[0])[1]
    return float(best[0]), float(best[1])
