"""ddplab.checkpoint on one process: atomic saves, the commit record, clear errors, exact RNG."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import REPO
from torch import nn

from ddplab import checkpoint as ck
from ddplab import checkpoint_dcp as dcpck

CPU = torch.device("cpu")


def state(value: float) -> dict:
    return {"model": {"w": torch.full((64, 64), float(value))}, "step": int(value)}


def test_save_writes_file_and_checksum_and_keeps_the_last_k(tmp_path):
    for step in range(1, 6):
        report = ck.save_checkpoint(state(step), tmp_path, step, keep_last=2)
        assert report.path == tmp_path / f"step_{step:07d}.pt"
        assert report.bytes == report.path.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_0000004.pt", "step_0000004.pt.sha256", "step_0000005.pt", "step_0000005.pt.sha256"]
    latest = ck.latest_checkpoint(tmp_path)
    assert ck.load_checkpoint(latest, CPU)["step"] == 5
    # the checksum file is in sha256sum's format: `sha256sum -c` can verify it by hand
    digest, name = ck.checksum_path(latest).read_text().split()
    assert name == latest.name and len(digest) == 64


def test_a_failed_rename_leaves_the_previous_checkpoint_in_charge(tmp_path, monkeypatch):
    ck.save_checkpoint(state(1), tmp_path, 1)

    def crash(*args):
        raise KeyboardInterrupt("stopped between write and rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(state(2), tmp_path, 2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000001.pt",
                                                          "step_0000001.pt.sha256"]
    assert ck.load_checkpoint(ck.latest_checkpoint(tmp_path), CPU)["step"] == 1


def test_a_process_killed_between_write_and_rename_leaves_only_a_temporary_file(tmp_path):
    code = ("import os, signal, sys, torch; from ddplab import checkpoint as ck; "
            "d = sys.argv[1]; ck.save_checkpoint({'step': 1}, d, 1); "
            "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL); "
            "ck.save_checkpoint({'step': 2, 'w': torch.zeros(1000)}, d, 2)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(REPO / "scripts")}, timeout=120)
    assert proc.returncode == -9, proc.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0].startswith(".step_0000002.pt.tmp-")  # complete bytes, but never renamed
    assert names[1:] == ["step_0000001.pt", "step_0000001.pt.sha256"]
    assert ck.load_checkpoint(ck.latest_checkpoint(tmp_path), CPU)["step"] == 1


def test_saving_a_step_again_drops_its_old_commit_record_first(tmp_path, monkeypatch):
    """Between the rename and the new checksum, the step must not look complete (its old
    checksum would not match the new file): it is unlisted, and the previous one is in charge."""
    ck.save_checkpoint(state(1), tmp_path, 1)
    ck.save_checkpoint(state(2), tmp_path, 2)

    def crash(*args):
        raise KeyboardInterrupt("stopped between the rename and the checksum")

    monkeypatch.setattr(ck, "_write_text_atomically", crash)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(state(20), tmp_path, 2)  # step 2 again
    monkeypatch.undo()
    assert ck.load_checkpoint(ck.latest_checkpoint(tmp_path), CPU)["step"] == 1


@pytest.fixture
def good(tmp_path):
    return ck.save_checkpoint(state(3), tmp_path / "good", 3).path


def test_a_flipped_byte_is_caught_although_torch_load_accepts_it(good):
    data = bytearray(good.read_bytes())
    at = bytes(data).find(torch.full((4,), 3.0).numpy().tobytes()) + 1  # inside the tensor
    assert at > 0
    data[at] ^= 0xFF
    good.write_bytes(bytes(data))
    assert torch.load(good, weights_only=True)["model"]["w"].ne(3.0).sum() == 1  # silently
    with pytest.raises(ck.CheckpointError, match=r"truncated or corrupted .* SHA-256 does not "
                                                  r"match step_0000003\.pt\.sha256"):
        ck.load_checkpoint(good, CPU)


def test_a_truncated_file_gets_one_clear_line(good):
    good.write_bytes(good.read_bytes()[:1000])
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(good, CPU)
    assert "truncated or corrupted (1000 bytes" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_file_without_its_checksum_was_never_finished(good):
    ck.checksum_path(good).unlink()
    assert ck.latest_checkpoint(good.parent) is None  # not listed as a checkpoint
    with pytest.raises(ck.CheckpointError, match="never completely written"):
        ck.load_checkpoint(good, CPU)


def test_missing_directory_and_file(tmp_path):
    with pytest.raises(ck.CheckpointError, match=r"directory .*nope does not exist"):
        ck.latest_checkpoint(tmp_path / "nope")
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.load_checkpoint(tmp_path / "step_0000001.pt", CPU)


def test_a_checkpoint_of_another_model_shape_is_refused_by_name():
    small, large = nn.Linear(4, 8), nn.Linear(4, 16)
    with pytest.raises(ck.CheckpointError, match=r"different model: bias is \[8\] there but "
                                                  r"\[16\] here \(2 tensor"):
        ck.load_model_state(large, small.state_dict(), "ckpt.pt")


def test_the_ddp_prefix_gets_a_hint():
    model = nn.Linear(4, 8)
    wrapped = {f"module.{k}": v for k, v in model.state_dict().items()}
    with pytest.raises(ck.CheckpointError, match=r"save model\.module\.state_dict\(\)"):
        ck.load_model_state(model, wrapped, "ckpt.pt")


def test_rng_state_brings_back_every_generator():
    saved = ck.rng_state(CPU)
    first = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    ck.set_rng_state(saved, CPU)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]


def test_rng_states_survive_weights_only_loading_and_need_the_same_world_size(tmp_path):
    ck.save_checkpoint({"rng": ck.gather_rng_states(CPU)}, tmp_path, 1)
    loaded = ck.load_checkpoint(ck.latest_checkpoint(tmp_path), CPU)["rng"]
    ck.restore_rng_states(loaded, CPU, tmp_path)  # one rank saved, one rank restores
    with pytest.raises(ck.CheckpointError, match="saved by 2 ranks, this run has 1"):
        ck.restore_rng_states(loaded * 2, CPU, tmp_path)


def test_resumable_sampler_continues_the_epoch_where_it_stopped():
    data = list(range(40))
    whole = ck.ResumableSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    whole.start_at(epoch=2, skip=0)
    resumed = ck.ResumableSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    resumed.start_at(epoch=2, skip=7)
    assert list(resumed) == list(whole)[7:] and len(resumed) == len(whole) - 7
    resumed.start_at(epoch=3, skip=0)  # the next epoch: from its start, in a new order
    assert len(resumed) == 20 and list(resumed) != list(whole)


def test_dcp_round_trip_in_place_with_pruning(tmp_path, one_rank):
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    for step in (1, 2, 3):
        dcpck.save_distributed(tmp_path, step, model, optimizer, {"step": step}, keep_last=2)
    assert [p.name for p in dcpck.list_distributed(tmp_path)] == ["step_0000002", "step_0000003"]
    expected_rand = torch.rand(3)  # the generator state was saved before this draw

    torch.manual_seed(1)
    fresh = nn.Linear(8, 4)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    latest = dcpck.list_distributed(tmp_path)[-1]
    extra = dcpck.load_distributed(latest, fresh, fresh_opt, {"step": 0})
    assert extra == {"step": 3}
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"],
                       optimizer.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(3), expected_rand)


def test_optimizer_state_loaded_on_the_cpu_keeps_step_on_the_cpu(tmp_path):
    """load_checkpoint maps to the CPU; load_state_dict moves the moments to each parameter's
    device but leaves ``step`` where it was loaded (optimizer.py,
    _process_value_according_to_param_policy): on a GPU, a step on the GPU would cost a host
    synchronization per parameter per step."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    ck.save_checkpoint({"optimizer": optimizer.state_dict()}, tmp_path, 1)
    loaded = ck.load_checkpoint(ck.latest_checkpoint(tmp_path))
    assert all(t.device.type == "cpu" for s in loaded["optimizer"]["state"].values()
               for t in s.values())
    fresh = torch.optim.AdamW(model.parameters())
    fresh.load_state_dict(loaded["optimizer"])
    assert fresh.state[model.weight]["step"].device.type == "cpu"


def test_dcp_loads_in_one_process_without_a_process_group(tmp_path, one_rank):
    """What a notebook does: dcp.load(..., no_dist=True) reads a checkpoint with no group."""
    import torch.distributed.checkpoint as dcp

    model = nn.Linear(8, 4)
    dcpck.save_distributed(tmp_path, 1, model, torch.optim.SGD(model.parameters(), lr=1), {})
    dist.destroy_process_group()
    try:
        plain = {"model": nn.Linear(8, 4).state_dict()}
        with pytest.warns(UserWarning, match="assuming the intent is to load in a single"):
            dcp.load(plain, checkpoint_id=tmp_path / "step_0000001", no_dist=True)
        assert torch.equal(plain["model"]["weight"], model.weight)
    finally:  # the fixture destroys the group it made
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
