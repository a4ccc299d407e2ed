"""make gpu-check: every chapter's --quick run on the GPUs of this box, in each mode it supports.

    python tools/gpu_check.py                # every chapter, every mode, into figures/gpu/
    python tools/gpu_check.py --chapters 05 06 --out /tmp/gpu

A box with 2+ GPUs runs nccl with one GPU per rank; a 1-GPU box runs two ranks sharing the GPU over
gloo and the nccl path with one rank.  Results go to figures/gpu/<mode>/chapterNN/, never over the
CPU reference in figures/chapterNN/ that the site shows.  Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from chapters import CHAPTERS  # noqa: E402
from ddplab.run.devices import gpu_count  # noqa: E402

# The numbers that tell at a glance whether a run made sense: the chapter registry's headlines.
HEADLINES = {c.nn: [h.key for h in c.headlines] for c in CHAPTERS}


@dataclass(frozen=True)
class Mode:
    name: str
    flags: tuple[str, ...]
    what: str


def modes_for(gpus: int) -> list[Mode]:
    """The ways this box can run a chapter on its GPUs (see ddplab.run.devices)."""
    if gpus >= 2:
        return [Mode("nccl", ("--device", "cuda", "--backend", "nccl"),
                     f"nccl, one GPU per rank ({gpus} ranks)")]
    if gpus == 1:
        return [Mode("shared-gloo", ("--device", "cuda", "--backend", "gloo", "--world-size", "2"),
                     "2 ranks share the GPU over gloo"),
                Mode("nccl-1rank", ("--device", "cuda", "--backend", "nccl", "--world-size", "1"),
                     "the nccl path with one rank")]
    return []


def chapter_scripts(wanted: list[str] | None) -> dict[str, Path]:
    scripts = {p.name[7:9]: p for p in sorted((REPO / "scripts").glob("chapter[0-9][0-9]_*.py"))}
    return {nn: p for nn, p in scripts.items() if not wanted or nn in wanted}


def lookup(results: dict, path: str):
    for key in path.split("."):
        if not isinstance(results, dict) or key not in results:
            return None
        results = results[key]
    return results


def headline(nn: str, results: dict) -> str:
    parts = []
    for path in HEADLINES.get(nn, []):
        value = lookup(results, path)
        if value is not None:
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            parts.append(f"{path.rsplit('.', 1)[-1]}={shown}")
    return ", ".join(parts) or "—"


def run_one(script: Path, mode: Mode, out: Path, timeout: float) -> tuple[bool, float, str]:
    """Run one chapter --quick in one mode; (ok, seconds, headline or the error's last line)."""
    start = time.perf_counter()
    cmd = [sys.executable, str(script), "--quick", "--out", str(out), *mode.flags]
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - start, f"did not finish in {timeout:g} s"
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return False, seconds, lines[-1] if lines else f"exit {proc.returncode}"
    nn = script.name[7:9]
    results = json.loads((out / f"chapter{nn}" / "results.json").read_text())
    return True, seconds, headline(nn, results)


def table(rows: list[tuple[str, str, bool, float, str]]) -> str:
    lines = [f"{'chapter':<8} {'mode':<12} {'ok':<3} {'seconds':>8}  headline",
             "-" * 72]
    for nn, mode, ok, seconds, note in rows:
        lines.append(f"{nn:<8} {mode:<12} {'✓' if ok else '✗':<3} {seconds:>8.1f}  {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, gpus: int | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().partition("\n")[0])
    parser.add_argument("--chapters", nargs="*", metavar="NN", help="default: every chapter")
    parser.add_argument("--out", type=Path, default=REPO / "figures" / "gpu", metavar="DIR")
    parser.add_argument("--timeout", type=float, default=300, metavar="SECONDS",
                        help="per chapter and mode (default: 300)")
    args = parser.parse_args(argv)
    gpus = gpu_count() if gpus is None else gpus
    modes = modes_for(gpus)
    if not modes:
        print("gpu-check: no CUDA GPU on this machine, nothing to check "
              "(make run-chapterNN runs on the CPU)")
        return 0
    rows = []
    for mode in modes:
        print(f"== {mode.name}: {mode.what}", flush=True)
        for nn, script in chapter_scripts(args.chapters).items():
            ok, seconds, note = run_one(script, mode, args.out / mode.name, args.timeout)
            rows.append((nn, mode.name, ok, seconds, note))
            print(f"   chapter {nn}: {'ok' if ok else 'FAILED'} in {seconds:.0f} s", flush=True)
    print(table(rows))
    failed = sum(not ok for _nn, _mode, ok, _s, _note in rows)
    if failed:
        print(f"error: {failed} chapter run(s) failed on the GPU; the table's last column says why",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
