"""The autocast type for a device: bf16 where it runs natively, fp16 + GradScaler otherwise.
The device's answer is faked (``torch.cuda.is_bf16_supported``), not CUDA itself."""

from __future__ import annotations

import pytest
import torch

from ddplab.precision import mixed_precision_for


@pytest.fixture
def gpu_has_bf16(monkeypatch):
    """Set what the (faked) GPU answers; remember whether emulation was asked to count."""
    asked = {}

    def answer(value: bool):
        def is_bf16_supported(including_emulation: bool = True) -> bool:
            asked["including_emulation"] = including_emulation
            return value
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
        return asked
    return answer


def test_cpu_uses_bf16_without_a_scaler():
    choice = mixed_precision_for(torch.device("cpu"))
    assert (choice.dtype, choice.needs_scaler) == (torch.bfloat16, False)
    assert choice.scaler(torch.device("cpu")) is None


def test_ampere_or_later_gpu_uses_bf16_without_a_scaler(gpu_has_bf16):
    asked = gpu_has_bf16(True)
    choice = mixed_precision_for(torch.device("cuda", 0))
    assert (choice.dtype, choice.needs_scaler) == (torch.bfloat16, False)
    assert asked["including_emulation"] is False   # emulated bf16 is slow: it must not count


def test_older_gpu_uses_fp16_with_a_grad_scaler(gpu_has_bf16):
    gpu_has_bf16(False)
    choice = mixed_precision_for(torch.device("cuda", 0))
    assert (choice.dtype, choice.needs_scaler) == (torch.float16, True)
    scaler = choice.scaler(torch.device("cpu"))   # the scaler's device type is passed through
    assert isinstance(scaler, torch.amp.GradScaler)
