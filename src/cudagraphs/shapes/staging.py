"""Bucketed static inputs: one buffer per input, sized for the largest rung, shared by every
bucket (as SGLang captures each batch size on ``input_ids[:n]``), so static inputs cost the
largest rung once however many buckets there are.

Each bucket's static input is a contiguous view of the buffer's first elements, shaped for that
bucket. A call copies its real data into the view's leading box and writes the pad value
everywhere else the graph reads, skipping what is known to hold pad already.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .spec import BucketedInput

__all__ = ["SharedInput"]


class SharedInput:
    """The static memory of one bucketed input, and what of it is known to hold pad.

    Inputs bucketed along dimension 0 only (the batch case) keep a row high-water mark: rows at
    or above it hold pad, whatever bucket wrote last. Others remember the box the last call wrote
    and which bucket's layout it was written in.
    """

    def __init__(self, inp: BucketedInput, example: torch.Tensor, largest: dict[str, int]):
        self.input = inp
        shape = list(example.shape)
        for d, symbol in inp.dims:
            shape[d] = largest[symbol]
        with torch.inference_mode(False), torch.no_grad():  # version counters must work
            self.flat = torch.full((math.prod(shape),), inp.pad, dtype=inp.dtype, device=inp.device)
        self.rows_only = inp.dims == ((0, inp.dims[0][1]),) if inp.dims else False
        self.row_numel = math.prod(shape[1:]) if self.rows_only else 0
        self.dirty_rows = shape[0] if self.rows_only else 0  # rows [0, dirty_rows) may hold data
        self.owner: Any = None  # the bucket whose layout the last box was written in
        self.clean: tuple[int, ...] | None = None  # outside this box, the owner's view holds pad

    def view(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The bucket's static input: the buffer's first elements, contiguous, in this shape."""
        return self.flat[: math.prod(shape)].view(shape)

    def stage_rows(self, x: torch.Tensor, view: torch.Tensor, n: int, rung: int) -> None:
        """Batch case: ``x`` (``n`` rows) into the view's first rows, pad in rows ``n..rung``."""
        if x is view:  # the caller filled the bucket's own buffer
            self.dirty_rows = max(self.dirty_rows, rung)
            return
        if n == rung:
            view.copy_(x)
        else:
            view[:n].copy_(x)
            if self.dirty_rows > n:
                view[n : min(self.dirty_rows, rung)].fill_(self.input.pad)
        self.dirty_rows = n if self.dirty_rows <= rung else self.dirty_rows

    def stage_box(
        self, x: torch.Tensor, view: torch.Tensor, sizes: tuple[int, ...], owner: Any
    ) -> None:
        """General case: ``x`` into the view's leading box, pad outside it."""
        if self.rows_only:
            self.stage_rows(x, view, sizes[0], view.shape[0])
            return
        if x is not view:
            prefix = view
            for (d, _), n in zip(self.input.dims, sizes):
                prefix = prefix.narrow(d, 0, n)
            prefix.copy_(x)
        if (
            self.owner == owner
            and self.clean is not None
            and all(c <= n for c, n in zip(self.clean, sizes))
        ):
            self.clean = sizes  # outside the new box lies within outside the old: pad already
            return
        box = view
        for (d, _), n in zip(self.input.dims, sizes):
            if n < box.shape[d]:
                box.narrow(d, n, box.shape[d] - n).fill_(self.input.pad)
            box = box.narrow(d, 0, n)
        self.owner, self.clean = owner, sizes

    def rows_written(self, rung: int) -> None:
        """Batch case: a call is copying all ``rung`` rows of the bucket's view itself."""
        self.dirty_rows = max(self.dirty_rows, rung)

    def written_by_function(self, rung_rows: int) -> None:
        """The function wrote into its static input: anywhere in the view may hold data."""
        self.dirty_rows = max(self.dirty_rows, rung_rows)
        self.owner, self.clean = None, None
