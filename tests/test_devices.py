"""--device/--backend placement and make gpu-check, tested on a CPU machine by telling the planner
how many GPUs to assume (the GPU run itself needs a GPU box: `make gpu-check`)."""

from __future__ import annotations

import json

import gpu_check  # scripts/ is on pytest's pythonpath
import pytest
import torch
from conftest import refuse_in_process

from ddplab.run.cli import UsageError
from ddplab.run.devices import place


@pytest.mark.parametrize(("device", "backend", "ranks", "gpus", "expected"), [
    ("auto", "auto", 2, 0, ("gloo", "cpu")),  # a laptop
    ("auto", "auto", 8, 8, ("nccl", "cuda")),  # one GPU per rank
    ("auto", "auto", 2, 1, ("gloo", "cuda")),  # a 1-GPU box: the ranks share it over gloo
    ("auto", "auto", 1, 1, ("nccl", "cuda")),  # the nccl path with one rank
    ("auto", "gloo", 2, 4, ("gloo", "cpu")),   # --backend gloo alone keeps the CPU, as before
    ("cuda", "gloo", 4, 2, ("gloo", "cuda")),  # CUDA tensors through gloo, GPUs shared
    ("cpu", "auto", 2, 8, ("gloo", "cpu")),
])
def test_placement(device, backend, ranks, gpus, expected):
    got = place(device, backend, ranks, gpus=gpus, nccl_available=True)
    assert (got.backend, got.device_type) == expected


def test_shared_gpu_maps_every_rank_onto_the_gpus_there_are():
    shared = place("cuda", "gloo", 3, gpus=1, nccl_available=True)
    assert [shared.device_for(r) for r in range(3)] == [torch.device("cuda", 0)] * 3
    assert shared.shares_gpu(3)
    own = place("cuda", "nccl", 2, gpus=2, nccl_available=True)
    assert [own.device_for(r) for r in range(2)] == [torch.device("cuda", 0),
                                                       torch.device("cuda", 1)]
    assert not own.shares_gpu(2)


@pytest.mark.parametrize(("device", "backend", "ranks", "gpus", "nccl", "says"), [
    ("cuda", "auto", 2, 0, True, "--device cuda: no CUDA GPU is visible"),
    ("cpu", "nccl", 2, 2, True, "nccl moves CUDA tensors only"),
    ("auto", "nccl", 2, 1, True, "needs one GPU per rank: 2 ranks on this machine but 1 GPU"),
    ("auto", "nccl", 2, 2, False, "this torch build has no NCCL"),
    ("gpu", "auto", 2, 2, True, "--device must be one of auto, cpu, cuda"),
])
def test_impossible_combinations_are_one_clear_line(device, backend, ranks, gpus, nccl, says):
    with pytest.raises(UsageError, match=says):
        place(device, backend, ranks, gpus=gpus, nccl_available=nccl)


def test_gpu_check_modes():
    assert gpu_check.modes_for(0) == []
    assert [m.name for m in gpu_check.modes_for(1)] == ["shared-gloo", "nccl-1rank"]
    assert [m.name for m in gpu_check.modes_for(8)] == ["nccl"]
    for mode in gpu_check.modes_for(1) + gpu_check.modes_for(2):
        assert "--device" in mode.flags and "cuda" in mode.flags  # never silently on the CPU


def test_gpu_check_without_a_gpu_says_so_and_exits_0(capsys, tmp_path):
    assert gpu_check.main(["--out", str(tmp_path)], gpus=0) == 0
    assert "no CUDA GPU on this machine" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())  # and writes nothing


def test_gpu_check_table_reports_failures_and_headlines(monkeypatch, capsys, tmp_path):
    def fake_run(script, mode, out, timeout):
        nn = script.name[7:9]
        if nn == "02":
            return False, 1.0, "error: something broke on the GPU"
        # Chapter 03's headline is the busbw ratio at its largest size (a number, not the
        # dict by size that results.json keeps at the top level).
        return True, 2.0, gpu_check.headline(
            nn, {"correct": True, "largest": {"ratio_ring_to_native_busbw": 0.93}})
    monkeypatch.setattr(gpu_check, "run_one", fake_run)
    code = gpu_check.main(["--chapters", "02", "03", "--out", str(tmp_path)], gpus=1)
    out, err = capsys.readouterr()
    assert code == 1
    assert "02       shared-gloo  ✗" in out and "something broke on the GPU" in out
    assert "correct=True, ratio_ring_to_native_busbw=0.93" in out
    assert "2 chapter run(s) failed" in err  # chapter 02 in both modes


def test_headline_skips_missing_keys():
    results = json.loads('{"equivalence": {"bucketed_vs_native": 0.0}}')
    assert gpu_check.headline("05", results) == "bucketed_vs_native=0"
    assert gpu_check.headline("02", {}) == "—"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPU")
def test_a_chapter_refuses_device_cuda_without_a_gpu_in_one_line(tmp_path):
    code, err = refuse_in_process("scripts/chapter01_processes.py", "--device", "cuda", "--out",
                                  str(tmp_path))
    assert code == 2
    last = err.strip().splitlines()
    assert len(last) == 1 and "--device cuda: no CUDA GPU is visible" in last[0]


def test_point_to_point_chapters_keep_cpu_tensors_on_a_gpu_shared_over_gloo():
    from ddplab.run.ranks import RankContext, point_to_point_context

    def ctx(backend, device):
        return RankContext(rank=0, local_rank=0, world_size=2, backend=backend,
                           device=torch.device(device), seed=0, quick=True, launcher="mp.spawn")
    assert point_to_point_context(ctx("gloo", "cuda:0")).device == torch.device("cpu")
    assert point_to_point_context(ctx("nccl", "cuda:1")).device == torch.device("cuda", 1)
    assert point_to_point_context(ctx("gloo", "cpu")).device == torch.device("cpu")
