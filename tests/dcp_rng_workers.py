"""Rank function for the DCP generator test (importable, as mp.spawn requires)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ddplab import checkpoint_dcp as dcpck
from ddplab.run.launch import exit_without_teardown


def save_then_load_generators(rank: int, world: int, folder: str) -> None:
    """Each rank seeds its own generator, saves a DCP checkpoint, draws, scrambles its
    generator, loads, draws again; writes both draws and the keys it handed DCP."""
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    import torch.distributed.checkpoint as dcp
    original_save, handed = dcp.save, []

    def recording_save(state_dict, **kwargs):      # the keys this rank hands DCP
        handed.extend(_flat_keys(state_dict))
        return original_save(state_dict, **kwargs)
    dcp.save = recording_save
    try:
        torch.manual_seed(1000 + rank)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        path = dcpck.save_distributed(Path(folder), 1, model, optimizer, {"step": 1})
        before = torch.rand(4).tolist()
        torch.manual_seed(7)                     # the same scrambled state on every rank
        dcpck.load_distributed(path, model, optimizer, {"step": 0})
        after = torch.rand(4).tolist()
        keys = sorted(handed)
        Path(folder, f"rank{rank}.json").write_text(json.dumps(
            {"before": before, "after": after, "keys": keys}))
    finally:
        dcp.save = original_save
        dist.destroy_process_group()
    # The book's ranks end this way too: a rank's interpreter teardown can abort after the work
    # is done (ddplab.run.launch.exit_without_teardown says why); this test is about the keys.
    exit_without_teardown(0)


def _flat_keys(state: dict) -> list[str]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    flat, _ = flatten_state_dict(state)
    return list(flat)
