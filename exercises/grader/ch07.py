"""Chapter 07: checkpointing — an atomic save, the RNG state a resume needs, a checksum check."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import tempfile
from pathlib import Path

import torch

from .core import Context, Exercise
from .guard import Mistake


class Unpicklable:
    """Fails half-way through torch.save: a crash in the middle of writing a checkpoint."""

    def __reduce__(self):
        raise RuntimeError("simulated crash while writing")


def check_save(ctx: Context) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        state = {"step": 3, "weights": torch.arange(1000.0)}
        ctx.call(ctx.learner.save_atomic, state, path)
        if not path.is_file():
            raise Mistake(f"save_atomic wrote no file at the path it was given ({path.name})")
        loaded = torch.load(path, weights_only=False)
        if loaded["step"] != 3 or not torch.equal(loaded["weights"], state["weights"]):
            raise Mistake("the saved file does not load back as the state that was saved")
        _no_leftovers(tmp, "after a successful save")
        with contextlib.suppress(RuntimeError):  # the crash may propagate: that is fine
            ctx.call(ctx.learner.save_atomic, {"step": 4, "bad": Unpicklable(),
                                               "weights": torch.zeros(10**5)}, path)
        try:
            after = torch.load(path, weights_only=False)
        except Exception as error:
            raise Mistake(f"a save that crashed half-way destroyed the previous checkpoint "
                          f"(loading it now fails: {type(error).__name__}): write to a "
                          "temporary file in the same folder, then os.replace() it onto the "
                          "path, so the old file is replaced only by a complete new one") from None
        if after["step"] != 3:
            raise Mistake("after a crashed save, the checkpoint is not the previous one")
        _no_leftovers(tmp, "after a save that crashed")


def _no_leftovers(folder: str, when: str) -> None:
    extra = sorted(set(os.listdir(folder)) - {"checkpoint.pt"})
    if extra:
        raise Mistake(f"{when}, the folder holds {extra} besides the checkpoint: remove the "
                      "temporary file when the save fails (try/finally)")


def _draws() -> tuple:
    return (random.random(), torch.rand(3).tolist(), torch.randint(0, 10**6, (2,)).tolist())


def check_rng(ctx: Context) -> None:
    random.seed(5)
    torch.manual_seed(5)
    _draws()
    state = ctx.call(ctx.learner.capture_rng)
    with tempfile.TemporaryDirectory() as tmp:  # it must survive a trip through a file
        torch.save(state, Path(tmp) / "rng.pt")
        state = torch.load(Path(tmp) / "rng.pt", weights_only=False)
    want = _draws()
    random.seed(999)  # a restarted process starts from some other state
    torch.manual_seed(999)
    ctx.call(ctx.learner.restore_rng, state)
    got = _draws()
    names = ("Python's random.random()", "torch.rand", "torch.randint")
    if all(g != w for g, w in zip(got, want, strict=True)):
        raise Mistake("after restore_rng, no generator continued where it left off (Python's "
                      "random and torch's both drew other numbers than the run that was never "
                      "interrupted): a resume without the RNG state does not continue bit for "
                      "bit; capture random.getstate() and torch.get_rng_state()")
    for name, g, w in zip(names, got, want, strict=True):
        if g != w:
            which = ("random.getstate() / random.setstate()" if "Python" in name else
                     "torch.get_rng_state() / torch.set_rng_state()")
            raise Mistake(f"after restore_rng, {name} drew {g}, but the run that was never "
                          f"interrupted drew {w}: a resume without this RNG state does not "
                          f"continue bit for bit; capture and restore it ({which})")


def _write(folder: Path, step: int, payload: bytes, good: bool = True) -> Path:
    path = folder / f"step_{step:06d}.pt"
    path.write_bytes(payload)
    digest = hashlib.sha256(payload if good else payload + b"x").hexdigest()
    path.with_suffix(".sha256").write_text(digest + "\n")
    return path


def check_latest(ctx: Context) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if ctx.call(ctx.learner.latest_valid_checkpoint, folder) is not None:
            raise Mistake("an empty folder has no checkpoint: return None")
        _write(folder, 10, b"ten")
        good = _write(folder, 200, b"two hundred")
        _write(folder, 30, b"thirty")
        got = ctx.call(ctx.learner.latest_valid_checkpoint, folder)
        if got is None or Path(got) != good:
            hint = (" Sort by the step number, not by when the file was written."
                    if got is not None and Path(got).name == "step_000030.pt" else "")
            raise Mistake(f"of steps 10, 200 and 30 (all intact) it returned "
                          f"{Path(got).name if got else None}, expected step_000200.pt.{hint}")
        _write(folder, 300, b"three hundred, cut sh", good=False)  # a crash cut it short
        (folder / "step_000400.pt.tmp").write_bytes(b"half")  # a save that never finished
        (folder / "step_000500.pt").write_bytes(b"no checksum yet")
        got = ctx.call(ctx.learner.latest_valid_checkpoint, folder)
        if got is None or Path(got) != good:
            name = Path(got).name if got else None
            hint = {"step_000300.pt": "its checksum does not match (a crash cut it short): "
                                      "verify the SHA-256 before trusting a file",
                    "step_000500.pt": "it has no .sha256 file yet: the save never finished",
                    "step_000400.pt.tmp": "a temporary file is never a checkpoint"}.get(name, "")
            raise Mistake(f"it returned {name}, expected step_000200.pt, the newest intact "
                          f"checkpoint" + (f": {name} is not valid, {hint}" if hint else ""))


EXERCISES = [
    Exercise("07.1", "save_atomic", check_save, world_sizes=(1,)),
    Exercise("07.2", "capture_rng", check_rng, world_sizes=(1,)),
    Exercise("07.3", "latest_valid_checkpoint", check_latest, world_sizes=(1,)),
]
