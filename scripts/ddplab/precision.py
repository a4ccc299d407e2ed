"""Which 16-bit type autocast should use on a device, and whether it needs a GradScaler.

bfloat16 keeps float32's 8 exponent bits, so gradients neither overflow nor flush to zero more
than in float32, and no loss scaling is needed: the standard choice wherever the hardware has
fast bf16 (every CPU torch runs on, NVIDIA GPUs from Ampere on: ``torch.cuda.is_bf16_supported``).
Older GPUs (V100, T4) only have fast float16, whose 5 exponent bits make small gradients vanish:
there autocast uses float16 and a ``GradScaler`` scales the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype
    needs_scaler: bool

    def scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(device.type) if self.needs_scaler else None


# --8<-- [start:choose]
def mixed_precision_for(device: torch.device) -> Precision:
    """bf16 where the device runs it natively, else fp16 with a GradScaler."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return Precision(torch.float16, needs_scaler=True)
    return Precision(torch.bfloat16, needs_scaler=False)
# --8<-- [end:choose]
