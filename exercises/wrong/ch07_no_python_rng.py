"""Mistakes: a resume that restores torch's RNG but not Python's; temp files left on failure."""

import os

import torch

from exercises.solutions.chapter07_checkpointing import latest_valid_checkpoint  # noqa: F401


def save_atomic(state, path):
    tmp = str(path) + ".tmp"
    torch.save(state, tmp)  # on a crash, the .tmp stays behind
    os.replace(tmp, path)


def capture_rng():
    return {"torch": torch.get_rng_state()}


def restore_rng(state):
    torch.set_rng_state(state["torch"])
