"""The read floor bench_quant puts beside the batch-1 forward reads every weight it is given."""

from __future__ import annotations

import torch

from loadtest.read_floor import ReadFloor


def test_every_weight_is_read_once() -> None:
    # Sizes in whole 256-byte steps of each thread's share, so every byte is read as float32.
    weights = [torch.ones(128 * k) for k in (1, 3, 10, 64)]
    floor = ReadFloor(weights)
    assert floor.nbytes == 4 * 128 * 78
    assert floor.read() == 128 * 78
    assert floor.seconds() > 0
