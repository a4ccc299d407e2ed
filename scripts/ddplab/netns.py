"""Two emulated machines on one box: Linux network namespaces joined by a rate-limited cable.

A network namespace is a private copy of the network stack: its own interfaces, addresses and
routes.  Two of them, joined by a veth pair (a virtual cable: what goes in one end comes out of
the other), behave like two hosts on a switch.  ``tc qdisc ... tbf`` (token bucket filter) caps
how fast each end may send, so the cable can be a 100 Mbit/s or 1 Gbit/s link.

Safety rules this module keeps:
* it touches only what it created: two namespaces and one veth pair named ``ddpl-<pid>-...``,
  with private addresses (10.213.0.0/30) that exist only inside those namespaces;
* ``close()`` kills every process still inside the two namespaces (only processes this run
  started can be there), then deletes the namespaces, which deletes the cable with them;
* every ``ip``/``tc`` command has a timeout.

Needs root and iproute2 (``ip``, ``tc``); ``unavailable_reason()`` says why not, in one line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

SUBNET_ADDRESSES = ("10.213.0.1", "10.213.0.2")  # private (RFC 1918), only on our veth
PREFIX = 30
_CMD_TIMEOUT_S = 10.0


def unavailable_reason() -> str | None:
    """None when two emulated nodes can be built here, else why not (one line)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (run as root, e.g. in a VM or container)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S,
                          check=check)


@dataclass
class Node:
    """One emulated machine: a namespace, its end of the cable, and its address."""

    namespace: str
    interface: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this node: it sees only this node's network."""
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass
class TwoNodes:
    """Build with ``TwoNodes.create()``; always ``close()`` (or use it as a context manager)."""

    tag: str
    nodes: tuple[Node, Node]
    rate_mbit: float | None = None
    _closed: bool = field(default=False, repr=False)

    # --8<-- [start:create]
    @classmethod
    def create(cls, tag: str | None = None) -> TwoNodes:
        tag = tag or f"ddpl-{os.getpid()}"
        a, b = (Node(f"{tag}-{n}", f"{tag[:10]}{n}", addr)  # interface names: <= 15 chars
                for n, addr in zip("ab", SUBNET_ADDRESSES, strict=True))
        pair = cls(tag, (a, b))
        try:
            for node in pair.nodes:
                _run("ip", "netns", "add", node.namespace)
            _run("ip", "link", "add", a.interface, "type", "veth", "peer", "name", b.interface)
            for node in pair.nodes:
                _run("ip", "link", "set", node.interface, "netns", node.namespace)
                _run("ip", "-n", node.namespace, "addr", "add",
                     f"{node.address}/{PREFIX}", "dev", node.interface)
                _run("ip", "-n", node.namespace, "link", "set", node.interface, "up")
                _run("ip", "-n", node.namespace, "link", "set", "lo", "up")
        except BaseException:
            pair.close()  # half-built: take down what exists
            raise
        return pair
    # --8<-- [end:create]

    # --8<-- [start:shape]
    def set_rate(self, mbit: float | None) -> None:
        """Cap each direction of the cable at ``mbit`` Mbit/s (None: unshaped)."""
        for node in self.nodes:
            _run("tc", "-n", node.namespace, "qdisc", "del", "dev", node.interface, "root",
                 check=False)  # nothing to delete the first time
            if mbit is not None:
                # tbf: tokens arrive at `rate`; a packet leaves only with tokens for its bytes.
                # burst: the bucket's size; latency: how long a packet may queue for tokens.
                burst = max(32_000, int(mbit * 1e6 / 8 / 250))  # >= 4 ms of traffic
                _run("tc", "-n", node.namespace, "qdisc", "add", "dev", node.interface, "root",
                     "tbf", "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "100ms")
        self.rate_mbit = mbit
    # --8<-- [end:shape]

    def pids(self, node: Node | None = None) -> list[int]:
        """Processes running inside one namespace, or both (only ones this run started)."""
        found = []
        for each in [node] if node else self.nodes:
            out = _run("ip", "netns", "pids", each.namespace, check=False).stdout
            found += [int(p) for p in out.split()]
        return found

    def kill(self, node: Node | None = None, sig: int = signal.SIGKILL) -> None:
        """Signal everything inside one node (a machine losing power), or both."""
        for pid in self.pids(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def exists(self) -> dict[str, bool]:
        """What of this pair is still on the machine (the tests check it is nothing)."""
        names = _run("ip", "netns", "list", check=False).stdout.split()
        found = {node.namespace: node.namespace in names for node in self.nodes}
        for node in self.nodes:  # an interface lives in its namespace, or (half-built) the host
            links = _run("ip", "-o", "link", "show", check=False).stdout
            if node.namespace in names:
                links += _run("ip", "-n", node.namespace, "-o", "link", "show",
                              check=False).stdout
            found[node.interface] = f" {node.interface}@" in links or f" {node.interface}:" in links
        return found

    def close(self) -> None:
        """Kill what runs inside, delete both namespaces (the cable goes with them)."""
        if self._closed:
            return
        self._closed = True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            self.kill(sig=sig)
            deadline = time.monotonic() + 3.0
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.1)
        for node in self.nodes:
            _run("ip", "netns", "del", node.namespace, check=False)
        # A veth whose namespace move failed stays in the host namespace: remove it too.
        _run("ip", "link", "del", self.nodes[0].interface, check=False)

    def __enter__(self) -> TwoNodes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
