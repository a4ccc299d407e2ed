"""One look for every figure in the book.

Figures are read on a web page, often on a laptop: they are drawn 7 inches wide (the page's
text width), with text large enough to read without zooming, colours from the Okabe-Ito palette
(safe for the common kinds of colour blindness), and every axis labelled with its unit.
The same concept has the same colour in every chapter: communication is always orange.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no window, works over ssh and in CI

import matplotlib.pyplot as plt

# Okabe & Ito (2008), "Color Universal Design".
OKABE_ITO = {
    "black": "#000000", "orange": "#E69F00", "sky": "#56B4E9", "green": "#009E73",
    "yellow": "#F0E442", "blue": "#0072B2", "vermillion": "#D55E00", "purple": "#CC79A7",
    "grey": "#999999",
}

# What each colour means, across the whole book.
COLORS = {
    "forward": OKABE_ITO["sky"], "backward": OKABE_ITO["blue"], "compute": OKABE_ITO["blue"],
    "comm": OKABE_ITO["orange"], "optimizer": OKABE_ITO["green"], "idle": "#DDDDDD",
    "wait": OKABE_ITO["grey"], "data": OKABE_ITO["purple"], "eval": OKABE_ITO["vermillion"],
    "local": OKABE_ITO["grey"], "naive": OKABE_ITO["vermillion"],
    "bucketed": OKABE_ITO["blue"], "native": OKABE_ITO["green"],
    "ring": OKABE_ITO["blue"], "naive_allreduce": OKABE_ITO["vermillion"],
    "model": OKABE_ITO["black"],
}

# One colour per rank, for figures that draw ranks side by side.
RANK_COLORS = [OKABE_ITO[c] for c in
               ("blue", "orange", "green", "vermillion", "purple", "sky", "yellow", "black")]

PAGE_WIDTH_IN = 7.0
DPI = 150

STYLE = {
    "figure.dpi": DPI, "savefig.dpi": DPI, "savefig.bbox": "tight", "savefig.pad_inches": 0.05,
    "font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 9,
    "xtick.labelsize": 9, "ytick.labelsize": 9,
    "axes.spines.top": False, "axes.spines.right": False,
    "axes.grid": True, "grid.color": "#E5E5E5", "grid.linewidth": 0.8, "axes.axisbelow": True,
    "axes.prop_cycle": matplotlib.cycler(color=RANK_COLORS),
    "legend.frameon": False,
}


plt.rcParams.update(STYLE)  # importing this module is opting in to the book's style


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def figure(nrows: int = 1, ncols: int = 1, *, height: float = 3.2, width: float = PAGE_WIDTH_IN,
           **kwargs):
    """``plt.subplots`` at the book's page width; returns ``(fig, axes)``."""
    return plt.subplots(nrows, ncols, figsize=(width, height), **kwargs)


MAX_WIDTH_PX = 1000  # the site's column is about 850 px at 1280: a figure shows at >= 80 %


def save(fig, path: Path) -> Path:
    """Save as PNG and free the figure's memory (a chapter draws many).

    A figure whose labels or legend reach past its width comes out wider than the page with
    ``bbox_inches="tight"``; it is saved at a lower resolution instead, so every figure fits the
    site's column and reads without zooming (a click still opens it at full size)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    width_px = int.from_bytes(path.read_bytes()[16:20], "big")  # the PNG header's width
    if width_px > MAX_WIDTH_PX:  # drawn wider than the page: the same figure, fewer pixels
        fig.savefig(path, format="png", dpi=DPI * MAX_WIDTH_PX / width_px * 0.99)
    plt.close(fig)
    return path
