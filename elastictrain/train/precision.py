"""``--precision``: autocast for the forward pass and the loss, and fp16's loss scaling.

bf16 keeps fp32's exponent range, so it needs no scaler. fp16 does: ``torch.amp.GradScaler``
multiplies the loss before backward, unscales before clipping and the optimizer step, and skips
the step (and halves the scale) when a gradient overflowed. Its scale and growth tracker are part of
every checkpoint (``TrainState.scaler``), so a resumed run scales exactly as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.dtype = PRECISIONS[name]
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
        self._skips: torch.Tensor | int = 0

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping: the gradients in their true units."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        # The scale only ever drops on an overflow, and comparing on the device costs no host
        # sync per step (GradScaler.get_scale() would). ``_scale`` has been its tensor since 1.6.
        before = self.scaler._scale.clone()
        self.scaler.step(optimizer)
        self.scaler.update()
        self._skips = self._skips + (self.scaler._scale < before).to(torch.int64)

    def take_skips(self) -> int:
        """Optimizer steps the scaler skipped since the last call (a host sync: report time only)."""
        skips, self._skips = self._skips, 0
        return int(skips)
