"""Chapter 09's CUDA branches, checked on the CPU by faking the device's answers (not CUDA):
where a max-over-ranks tensor travels on nccl, and when the clock waits for the GPU."""

from __future__ import annotations

from types import SimpleNamespace

import chapter09_compression as ch09
import torch

from ddplab import ranks


def test_nccl_collectives_travel_through_this_ranks_gpu(monkeypatch):
    monkeypatch.setattr(ranks.dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert ranks.collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(ranks.dist, "get_backend", lambda *a: "gloo")
    assert ranks.collective_device() == torch.device("cpu")


def test_chapter09_takes_its_maximum_through_the_shared_helper(monkeypatch):
    seen = []

    def fake_max_over_ranks(values: torch.Tensor) -> torch.Tensor:
        seen.append(values)
        return values
    monkeypatch.setattr(ch09, "max_over_ranks", fake_max_over_ranks)
    assert ch09.slowest(2.5) == 2.5
    assert seen and seen[0].dtype == torch.float64


def test_the_clock_waits_for_the_gpu_only_on_a_gpu(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    ch09.wait_for_device(SimpleNamespace(device=torch.device("cpu")))
    assert synced == []
    ch09.wait_for_device(SimpleNamespace(device=torch.device("cuda", 1)))
    assert synced == [torch.device("cuda", 1)]


def test_the_scaler_follows_the_devices_bf16_answer(monkeypatch):
    gpu = SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert ch09.scaler_for(gpu) is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert isinstance(ch09.scaler_for(gpu), torch.amp.GradScaler)
