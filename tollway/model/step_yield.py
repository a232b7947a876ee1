"""Asking a step in flight to stop between two of its layers (row_ops.c's decoder_layers), so a
fast request that arrives during a long step waits for one layer of it, not all of them.

Another thread asks (the server's, as it hands the engine a fast request); the engine thread
sets a deadline where it runs a stopped step on in slices beside fast steps. The step stops only
where the runner let it (ModelRunner.execute's `pausable`), and is run on from the layer where it
stopped: the same operations on the same rows, so the same bits."""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch


class StepYield:
    def __init__(self):
        self._flag = ctypes.c_int32(0)  # read by the native layer loop between layers
        self.deadline: float | None = None  # time.monotonic() seconds (CLOCK_MONOTONIC, as the C side reads)

    def ask(self) -> None:
        """Stop the step in flight after the layer it is in (from any thread)."""
        self._flag.value = 1

    def clear(self) -> None:
        """The engine has taken in what asked: later steps run on (until asked again)."""
        self._flag.value = 0

    @property
    def flag_address(self) -> int:
        return ctypes.addressof(self._flag)

    def deadline_ns(self) -> int:
        """The deadline as the C side takes it: CLOCK_MONOTONIC nanoseconds, 0 for none."""
        return 0 if self.deadline is None else max(1, int(self.deadline * 1e9))



class Paused(NamedTuple):
    """A step's layers stopped between two of them: every row's hidden state after `layer` layers."""

    x: torch.Tensor
    layer: int
