"""Chapter 09's CUDA branches, checked on the CPU by faking the device's answers (not CUDA):
where a max-over-ranks tensor travels on nccl, and when the clock waits for the GPU."""

from __future__ import annotations

from types import SimpleNamespace

import chapter09_compression as ch09
import torch

from ddplab.run import ranks


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


def test_gpu_peak_memory_is_measured_from_the_right_baseline(monkeypatch):
    """PeakMemory on a GPU: the peak is reset when each block starts, so a later block reports
    its own peak, measured above the earlier block's baseline when asked (``since=``)."""
    from ddplab.run import memory
    gpu = {"allocated": 100 * memory.MiB, "peak": 100 * memory.MiB}

    def allocate(mib: int) -> None:
        gpu["allocated"] += mib * memory.MiB
        gpu["peak"] = max(gpu["peak"], gpu["allocated"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: gpu.update(peak=gpu["allocated"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: gpu["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: gpu["peak"])
    device = torch.device("cuda", 0)
    with memory.PeakMemory(device) as setup:
        allocate(40)                  # kept: the model's state
        allocate(30)
        allocate(-30)                 # a temporary, freed
    with memory.PeakMemory(device, since=setup) as steady:
        allocate(10)
        allocate(-10)
    assert setup.mib == 70            # the temporary counted at its peak
    assert steady.mib == 50           # 40 kept + 10 at this block's peak, above setup's baseline
