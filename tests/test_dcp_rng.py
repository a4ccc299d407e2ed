"""DCP checkpoints every rank's generators under keys that are the same on every rank (as
``dcp.load`` requires), and each rank gets its own generator back."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp
from dcp_rng_workers import save_then_load_generators

WORLD = 2


@pytest.mark.slow
def test_each_rank_resumes_its_own_generator_under_common_keys(tmp_path):
    mp.spawn(save_then_load_generators, args=(WORLD, str(tmp_path)), nprocs=WORLD)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in ranks:
        assert r["after"] == r["before"]       # its own generator, exactly where it was saved
    assert ranks[0]["before"] != ranks[1]["before"]   # and the ranks' generators differ
    assert ranks[0]["keys"] == ranks[1]["keys"]       # the same keys on every rank
    assert not any("rank" in key for key in ranks[0]["keys"])
