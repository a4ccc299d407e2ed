"""Chapter 10's plumbing: its flags (the reader's, and the hidden ones a node's ranks get), and
the run on one screen: each measured step against the model's prediction, and the failover.
The story (two emulated nodes, the failover, the model checked and projected) stays in
scripts/chapter10_many_nodes.py.
"""

from __future__ import annotations

import argparse

from . import costmodel
from .cli import positive


def add_flags(parser: argparse.ArgumentParser) -> None:
    """--gpus, --link, --per-node, --algo (a prediction), --node-budget, --failover; and the
    hidden flags the chapter passes to the ranks it starts on each node."""
    parser.add_argument("--gpus", type=positive(int), default=None,
                        help="also predict a step on this many GPUs")
    parser.add_argument("--link", choices=sorted(costmodel.LINKS), default="ib-ndr",
                        help="the link between nodes, for --gpus (default: ib-ndr)")
    parser.add_argument("--per-node", type=positive(int), default=8,
                        help="GPUs per node, for --gpus (default: 8)")
    parser.add_argument("--algo", choices=("ring", "tree"), default="ring",
                        help="all-reduce across nodes, for --gpus (default: ring)")
    parser.add_argument("--node-budget", type=positive(float), default=300.0,
                        help="seconds the two-node run may take in all (default: 300)")
    parser.add_argument("--failover", action=argparse.BooleanOptionalAction, default=None,
                        help="kill a node mid-training and resume (default: on, off with --quick)")
    hidden = {"help": argparse.SUPPRESS}
    # tests: node b dies this many seconds after the first phase started
    parser.add_argument("--kill-node-after", type=float, default=None, **hidden)
    parser.add_argument("--node-worker", action="store_true", **hidden)
    parser.add_argument("--nodes", type=int, default=1, **hidden)
    parser.add_argument("--phases", default="loopback", **hidden)
    parser.add_argument("--phase-dir", default=None, **hidden)
    parser.add_argument("--node-result", default=None, **hidden)


def summarize(metrics: dict) -> str:
    """Each run's measured step against the prediction; then the failover, if it ran."""
    lines = []
    for name, row in metrics["validation"]["runs"].items():
        lines.append(f"{name:>14}: measured {row['measured_ms']:8.1f} ms (compute "
                     f"{row['compute_ms']:.1f}), predicted {row['predicted_ms']:8.1f} ms, "
                     f"error {row['rel_error']:.0%}; from its own all-reduce timings "
                     f"{row['predicted_own_allreduce_ms']:.1f} ms "
                     f"({row['rel_error_own_allreduce']:.0%})")
    two = metrics["two_node"]
    if two and "failover" in two:
        f = two["failover"]
        lines.append(f"failover: node b killed, relaunched; resumed from step "
                     f"{f['resumed_from_step']} (torchrun restart {f['attempt']}); "
                     f"max |Δparam| vs uninterrupted = {f['max_abs_diff']:g}")
    return "\n".join(lines)
