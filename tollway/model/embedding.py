"""The token embedding: a step's rows of the table, read where the table lies.

A GGUF's table stays the file's blocks in its memory map, and only the rows a step's tokens name
are decoded (qmatmul.c's gguf_rows): no float copy of a table that is the model's largest tensor
(262k x 640 float32 is 671 MB for the default model's 170 MB of Q8_0), and the pages of rows no
token names are never read. A float table (an HF folder's, or where the native library is
missing) is kept as float32 on the device."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tollway.model.native.qmatmul import Q8Library
from tollway.model.weights import GGUFWeight


class Embedding:
    def __init__(self, weight: torch.Tensor | GGUFWeight, scale: float | None, device: torch.device,
                 q8: Q8Library | None):
        """`scale`: what each row is multiplied by (Gemma's sqrt(hidden)), or None."""
        self.vocab, self.hidden = weight.shape
        self.scale = torch.tensor(scale, dtype=torch.float32, device=device) if scale is not None else None
        self._q8 = q8 if device.type == "cpu" else None
        if isinstance(weight, GGUFWeight) and self._q8 is not None and self._q8.reads_gguf_rows(weight.gguf_type.value):
            self.table, self.type_code = weight.blocks, weight.gguf_type.value
            self.dense = None
        else:
            self.dense = weight.float().to(device)
            self.table, self.type_code = None, GGMLQuantizationType.F32.value
            if self._q8 is not None:  # read by gguf_rows as an F32 table, in the native greedy step
                self.table = self.dense.numpy()
        self.device = device

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids` times the scale: [len(ids), hidden] float32 on the device."""
        if self._q8 is not None:
            return self._q8.gguf_rows(self.type_code, self.table, self.hidden, ids, self.scale)
        rows = self.dense.index_select(0, ids.to(self.dense.device))
        return rows if self.scale is None else rows * self.scale

    @property
    def row_bytes(self) -> int:
        return self.table.strides[0]

    @property
    def address(self) -> int:
        return self.table.ctypes.data

    @property
    def nbytes(self) -> int:
        """What the table takes: its blocks where it lies in the file, or its float copy."""
        return self.dense.numel() * 4 if self.dense is not None else int(np.prod(self.table.shape))
