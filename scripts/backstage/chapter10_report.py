"""Chapter 10's plumbing: the hidden flags a node's ranks get, a node's environment, a node's
failure as one line, and the run on one screen: each measured step against the model's
prediction, and the failovers.
The story (two emulated nodes, the failover, the model checked and projected) stays in
scripts/chapter10_many_nodes.py.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ddplab.run import netns
from ddplab.run.launch import RankFailed


def add_node_flags(parser: argparse.ArgumentParser) -> None:
    """The hidden flags the chapter passes to the ranks it starts on each node."""
    # tests: node b dies this many seconds after the first phase started
    parser.add_argument("--kill-node-after", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--node-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nodes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--phases", default="loopback", help=argparse.SUPPRESS)
    parser.add_argument("--phase-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--node-result", default=None, help=argparse.SUPPRESS)


def node_tmpdir(scratch: Path, node: netns.Node) -> str:
    """A node's own temporary directory, inside the run's: torchrun's torchelastic_* files
    go with the run (the node's environment is built from scratch, without the reader's)."""
    path = scratch / f"tmp-{node.namespace}"
    path.mkdir(exist_ok=True)
    return str(path)


def failover_env(scratch: Path, node: netns.Node) -> dict:
    return {"GLOO_SOCKET_IFNAME": node.interface, "PYTHONUNBUFFERED": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # see chapter 07
            "TMPDIR": node_tmpdir(scratch, node), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def wait_until(condition, deadline: float, what: str) -> None:
    while not condition():
        if time.monotonic() > deadline:
            raise NodeFailed(f"failover: {what} did not happen in time")
        time.sleep(0.05)


class NodeFailed(RankFailed):
    def __init__(self, summary: str, details: str = ""):
        Exception.__init__(self, summary)
        self.rank, self.details = -1, details


CAUSES = ("error: ", "Connection closed by peer", "Connection reset by peer", "timeout",
          "Error")  # the most telling line of a node's log, best first


def node_failure(scratch: Path, procs) -> NodeFailed:
    """One line naming the node that failed and its most telling error; the log as details."""
    for node, proc in zip("ab", procs, strict=True):
        log = (scratch / f"node-{node}.log").read_text(errors="replace")
        lines = [ln.strip() for ln in log.splitlines()]
        for cause in CAUSES:
            found = [ln for ln in lines if cause in ln]
            if proc.returncode not in (None, 0) and found:
                return NodeFailed(f"node {node} stopped (exit {proc.returncode}): "
                                  f"{found[0][:300]}", log[-3000:])
    return NodeFailed("the two-node run ended without a result (node logs above)",
                      (scratch / "node-a.log").read_text(errors="replace")[-3000:])


def node_failure_from(log_path: Path, what: str) -> NodeFailed:
    log = log_path.read_text(errors="replace")
    lines = [ln.strip() for ln in log.splitlines() if "rror" in ln]
    return NodeFailed(f"{what}: node a failed: {lines[-1][:300] if lines else 'see its log'}",
                      log[-3000:])


TIMEOUT_SIGNS = ("Timed out", "timed out")
LOSS_SIGNS = ("Connection closed by peer", "Connection reset by peer", *TIMEOUT_SIGNS)


def how_node_a_heard(log_path: Path) -> str | None:
    """The line of node a's log that shows how its ranks learnt of the loss: the peer's kernel
    closing the connection, or a collective timing out (nothing arrived).

    A timeout line wins wherever it is. The log interleaves node a's two ranks, so the first
    line is not always the first cause: after a power cut the rank that times out exits, and its
    sibling may print "closed by peer" about *that* rank before the timeout line reaches the log.
    A collective that timed out waited the whole timeout with nothing arriving from node b."""
    lines = [line.strip()[:300] for line in log_path.read_text(errors="replace").splitlines()
             if any(sign in line for sign in LOSS_SIGNS)]
    timeouts = [line for line in lines if any(sign in line for sign in TIMEOUT_SIGNS)]
    return (timeouts or lines or [None])[0]


def summarize(metrics: dict) -> str:
    """Each run's measured step against the prediction; then the failover, if it ran."""
    lines = []
    for name, row in metrics["validation"]["runs"].items():
        lines.append(f"{name:>14}: measured {row['measured_ms']:8.1f} ms (compute "
                     f"{row['compute_ms']:.1f}), predicted {row['predicted_ms']:8.1f} ms, "
                     f"error {row['rel_error']:.0%}; from its own all-reduce timings "
                     f"{row['predicted_own_allreduce_ms']:.1f} ms "
                     f"({row['rel_error_own_allreduce']:.0%})")
    two = metrics["two_node"] or {}
    for key, what in (("failover", "killed"), ("power_cut", "lost power")):
        if key in two:
            f = two[key]
            lines.append(f"failover: node b {what}, node a's ranks ended after "
                         f"{f['detected_s']:.1f} s, b relaunched, a's new ranks after "
                         f"{f['restarted_s']:.1f} s; resumed from step "
                         f"{f['resumed_from_step']} (torchrun restart {f['attempt']}) "
                         f"{f['recovery_s']:.0f} s after the loss; max |Δparam| vs "
                         f"uninterrupted = {f['max_abs_diff']:g}")
    return "\n".join(lines)
