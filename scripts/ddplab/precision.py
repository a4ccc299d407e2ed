"""Which 16-bit type autocast should use on a device, and whether it needs a GradScaler.

bfloat16 keeps float32's 8 exponent bits, so gradients neither overflow nor flush to zero more
than in float32, and no loss scaling is needed.  It is chosen on every CPU, for that range and
for needing no ``GradScaler``, not for speed (only CPUs with bf16 instructions, AVX-512 BF16 or
AMX, compute it faster than float32), and on NVIDIA GPUs that run it natively (Ampere on:
``torch.cuda.is_bf16_supported``).  Older GPUs (V100, T4) only have fast float16, whose 5
exponent bits make small gradients vanish: there autocast uses float16 and a ``GradScaler``
scales the loss.
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
    """bf16 on every CPU (its range: no GradScaler) and on GPUs that run it natively; fp16
    with a GradScaler on older GPUs."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return Precision(torch.float16, needs_scaler=True)
    return Precision(torch.bfloat16, needs_scaler=False)
# --8<-- [end:choose]
