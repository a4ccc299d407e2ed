"""Two emulated machines on one box: Linux network namespaces joined by a rate-limited cable.

A network namespace is a private copy of the network stack: its own interfaces, addresses and
routes.  Two of them, joined by a veth pair (a virtual cable: what goes in one end comes out of
the other), behave like two hosts on a switch.  ``tc qdisc ... tbf`` (token bucket filter) caps
how fast each end may send, so the cable can be a 100 Mbit/s or 1 Gbit/s link.

Safety rules this module keeps:
* it touches only what it created: two namespaces and one veth pair named ``ddpl-<pid>-...``
  (``<pid>``: the process that made them), with private addresses (10.213.0.0/30) that exist
  only inside those namespaces;
* ``close()`` kills every process still inside the two namespaces (only processes this run
  started can be there), then deletes the namespaces, which deletes the cable with them;
* a run killed before it could ``close()`` (SIGKILL) leaves them behind: ``remove_leftovers()``
  deletes every pair whose creating process is gone, and never one whose creator still runs;
* every ``ip``/``tc`` command has a timeout.

Needs root and iproute2 (``ip``, ``tc``); ``unavailable_reason()`` says why not, in one line.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET_ADDRESSES = ("10.213.0.1", "10.213.0.2")  # private (RFC 1918), only on our veth
PREFIX = 30
_CMD_TIMEOUT_S = 10.0
TAG_PREFIX = "ddpl-"  # every name this module gives starts so, followed by the creator's PID
_GUARD = Path(__file__).with_name("node_guard.py")
_IFNAME_MAX = 15  # Linux's limit on an interface name
# What a run made: namespace ddpl-<pid>-a, a veth end left on the host ddpl-<pid>a, a scratch
# directory ddpl-<pid>-<what>-<random> (see scratch_dir_prefix).
_OURS = re.compile(rf"^{TAG_PREFIX}(\d+)(?:-[ab]|[ab]|-[a-z0-9]+-.*)$")


def unavailable_reason() -> str | None:
    """None when two emulated nodes can be built here, else why not (one line)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (run as root, e.g. in a VM or container)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    return None


def _interface_name(tag: str, node: str) -> str:
    """The tag and the node's letter, cut to Linux's 15 characters (a default tag fits)."""
    return f"{tag[:_IFNAME_MAX - 1]}{node}"


def scratch_dir_prefix(what: str) -> str:
    """``tempfile``'s prefix for a run's scratch directory, recognisable if the run is killed."""
    return f"{TAG_PREFIX}{os.getpid()}-{what}-"


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
        """``argv`` run inside this node: it sees only this node's network, and it ends with
        everything it started when this process dies (start it from the main thread)."""
        guard = [sys.executable, "-I", str(_GUARD), str(os.getpid())]
        return ["ip", "netns", "exec", self.namespace, *guard, *argv]


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
        tag = tag or f"{TAG_PREFIX}{os.getpid()}"
        a, b = (Node(f"{tag}-{n}", _interface_name(tag, n), addr)
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

    def cut_power(self, node: Node) -> None:
        """What a power cut looks like to the other node: ``node``'s cable goes dead first, so
        nothing it sends arrives (not even the FIN or RST its kernel sends for a killed
        process), then everything in it stops.  The other side hears nothing: it waits."""
        _run("ip", "-n", node.namespace, "link", "set", node.interface, "down")
        self.kill(node)

    def restore_power(self, node: Node) -> None:
        """``node``'s cable works again (its shaping stays): a replacement at the same address."""
        _run("ip", "-n", node.namespace, "link", "set", node.interface, "up")

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


# --- what a killed run left behind -------------------------------------------------------------

def _creator(name: str) -> int | None:
    """The PID in one of our names (``ddpl-<pid>-a``, ...), None for a name we did not give."""
    match = _OURS.match(name)
    return int(match.group(1)) if match else None


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _orphaned(names: list[str]) -> list[str]:
    return [n for n in names if (pid := _creator(n)) is not None and not _alive(pid)]


def remove_leftovers(scratch_root: str | None = None) -> list[str]:
    """Remove what runs killed before they could clean up left: the processes inside their
    namespaces, the namespaces (their veth ends and tbf qdiscs go with them), a veth end left
    on the host, and their scratch directories under ``scratch_root``.  Only names this module
    gives (``ddpl-<pid>...``), and only when process ``<pid>`` is gone.  Returns what went."""
    removed = []
    namespaces = _run("ip", "netns", "list", check=False).stdout.split()
    for name in _orphaned([n for n in namespaces if n.startswith(TAG_PREFIX)]):
        inside = [int(p) for p in _run("ip", "netns", "pids", name, check=False).stdout.split()]
        for pid in inside:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _run("ip", "netns", "del", name, check=False)
        removed.append(f"namespace {name}" + (f" ({len(inside)} processes)" if inside else ""))
    links = _run("ip", "-o", "link", "show", check=False).stdout
    host_ends = re.findall(rf"^\d+: ({TAG_PREFIX}\d+[ab])[@:]", links, flags=re.MULTILINE)
    for name in _orphaned(host_ends):
        _run("ip", "link", "del", name, check=False)
        removed.append(f"veth {name}")
    if scratch_root is not None and os.path.isdir(scratch_root):
        for name in _orphaned(sorted(os.listdir(scratch_root))):
            shutil.rmtree(os.path.join(scratch_root, name), ignore_errors=True)
            removed.append(f"directory {os.path.join(scratch_root, name)}")
    return removed


def leftovers_line(removed: list[str]) -> str:
    """One line saying what ``remove_leftovers`` removed."""
    return ("removed what an earlier two-node run left when it was killed: "
            + ", ".join(removed))
