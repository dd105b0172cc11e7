"""A tick's bitmask of allowed tokens, as llguidance writes it (daemon/engine/grammar.py), and
its application to the logits."""

from __future__ import annotations

from array import array

import llguidance
import torch


class Bitmask:
    """A tick's allowed tokens, a row of 32-bit words per constrained row (token 32w + j is bit
    j of word w): an array that Python and llguidance write, and a tensor over the same memory
    for the logits."""

    __slots__ = ("tensor", "width", "words")

    def __init__(self, rows: int, width: int) -> None:
        self.width = width
        self.words = array("i", bytes(4 * rows * width))
        self.tensor = torch.frombuffer(self.words, dtype=torch.int32).view(rows, width)

    def allows(self, row: int, token: int) -> bool:
        return bool(self.words[row * self.width + (token >> 5)] >> (token & 31) & 1)

    def address(self, row: int) -> int:
        return int(self.words.buffer_info()[0]) + 4 * self.width * row


def fill_row(matcher: llguidance.LLMatcher, bitmask: Bitmask, row: int) -> None:
    """The matcher's allowed tokens into row `row` of `bitmask`."""
    matcher.unsafe_compute_mask_ptr(bitmask.address(row), 4 * bitmask.width)


def bit(index: int) -> int:
    """Bit `index` of an int32 word, as a signed value."""
    return -(1 << 31) if index == 31 else 1 << index


# The eight bits of a byte, per device: a bitmask is read a byte at a time.
_BITS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: Bitmask) -> None:
    """Forbids, in place, every token a row's bitmask does not allow (`rows[i]` of `logits`,
    in increasing order, takes `bitmask[i]`); the mask crosses to the logits' device in one
    copy."""
    if not rows:
        return
    vocab = logits.shape[-1]
    words = bitmask.tensor.to(logits.device, non_blocking=True)
    bits = _BITS.get(logits.device)
    if bits is None:
        bits = _BITS[logits.device] = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8,
                                                   device=logits.device)
    # Token 32w + 8b + j is bit j of byte b of word w (little-endian words, as llguidance's).
    allowed = (words.view(torch.uint8).unsqueeze(-1) & bits).bool().flatten(1)[:, :vocab]
    if allowed.shape[1] < vocab:  # a head padded past the tokenizer: those ids never allowed
        allowed = torch.cat([allowed, allowed.new_zeros((len(rows), vocab - allowed.shape[1]))],
                            dim=1)
    if len(rows) == logits.shape[0]:  # every row: no copy
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index)
    logits.index_copy_(0, index, sub.masked_fill(~allowed, float("-inf")))
