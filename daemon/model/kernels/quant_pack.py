"""Quantized weights for the CPU kernels (quant.h): GGUF's block types decoded into unsigned
codes with a scale and an offset per block of 16 or 32 inputs (w = d u + m, exactly what the
file's own dequantization computes), weights quantized into the same, and the packing into
the layout the kernels stream.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import torch

from daemon.model.kernels.cpu import GROUP, TL_Q4, TL_Q8, TL_Q8_16, UNIT
from daemon.model.kernels.cpu import QUANTIZATIONS as QUANTIZATIONS

Q = gguf.GGMLQuantizationType
SHIFTS = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)


@dataclasses.dataclass(slots=True)
class Blocks:
    """A weight [N, K] as codes [N, K] (uint8) and d, m [N, K / bs] (float32)."""

    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray
    bs: int  # inputs per block: 16 or 32
    bits: int  # the codes' width: at most 4 bits pack two to a byte
    n_in: int | None = None  # the weight's inputs, where codes pad them to whole blocks

    @property
    def inputs(self) -> int:
        return self.codes.shape[1] if self.n_in is None else self.n_in

    @property
    def kind(self) -> int:
        """quant.h's weight type."""
        return TL_Q8_16 if self.bs == 16 else TL_Q4 if self.bits <= 4 else TL_Q8

    def dequantized(self) -> np.ndarray:
        n, k = self.codes.shape
        codes = self.codes.reshape(n, -1, self.bs).astype(np.float32)
        return (codes * self.d[..., None] + self.m[..., None]).reshape(n, k)[:, : self.inputs]

    def rows(self, index: np.ndarray | slice) -> Blocks:
        return Blocks(self.codes[index], self.d[index], self.m[index], self.bs, self.bits,
                      self.n_in)


def concat(parts: list[Blocks]) -> Blocks:
    """Rows of several weights as one (q, k and v; gate and up), in the finest block size and
    the widest codes of any part (a Q4_K file's Q6_K value rows beside Q4_K query rows)."""
    bs, bits = min(p.bs for p in parts), max(p.bits for p in parts)
    parts = [p if p.bs == bs else Blocks(p.codes, np.repeat(p.d, p.bs // bs, axis=1),
                                         np.repeat(p.m, p.bs // bs, axis=1), bs, bits)
             for p in parts]
    return Blocks(np.concatenate([p.codes for p in parts]), np.concatenate([p.d for p in parts]),
                  np.concatenate([p.m for p in parts]), bs, bits, parts[0].n_in)


# ---- GGUF's types


def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Low nibbles of `run` bytes, then their high nibbles, run after run."""
    n = qs.shape[0]
    return ((qs.reshape(n, -1, 1, run) >> SHIFTS) & 0x0F).reshape(n, -1)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit j of each byte of qh, [n, count, bytes] (j < count)."""
    shifts = np.arange(count, dtype=np.uint8).reshape(1, count, 1)
    return (qh.reshape(qh.shape[0], 1, -1) >> shifts) & 1


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """2-bit fields: bits (0, 2, 4, 6) of each run of 32 bytes in turn, run after run."""
    n = qs.shape[0]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(n, -1, 1, 32) >> shifts) & 3).reshape(n, -1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 6-bit scales and mins of 8 sub-blocks, packed in 12 bytes."""
    d, m, m_d = np.split(scales.reshape(-1, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(-1, 8).astype(np.float32), mins.reshape(-1, 8).astype(np.float32)


def _decode(b: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """One type's blocks [n, type size] as (codes [n, QK], d, m [n, QK / bs], bs, bits)."""
    if qtype == Q.Q8_0:
        d = _half(b[:, :2])
        codes = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d, -128 * d, 32, 8
    if qtype in (Q.Q4_0, Q.Q4_1):
        d = _half(b[:, :2])
        m = -8 * d if qtype == Q.Q4_0 else _half(b[:, 2:4])
        return _nibbles(b[:, 2 if qtype == Q.Q4_0 else 4 :], 16), d, m, 32, 4
    if qtype in (Q.Q5_0, Q.Q5_1):
        d = _half(b[:, :2])
        m = -16 * d if qtype == Q.Q5_0 else _half(b[:, 2:4])
        at = 2 if qtype == Q.Q5_0 else 4
        high = np.unpackbits(b[:, at : at + 4], axis=1, bitorder="little")
        return _nibbles(b[:, at + 4 :], 16) | (high << 4), d, m, 32, 8
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _half(b[:, :2]), _half(b[:, 2:4])
        sc, mins = _k_scales(b[:, 4:16])
        if qtype == Q.Q4_K:
            return _nibbles(b[:, 16:], 32), d * sc, -dmin * mins, 32, 4
        high = _bits(b[:, 16:48], 8).reshape(b.shape[0], -1)
        return _nibbles(b[:, 48:], 32) | (high << 4), d * sc, -dmin * mins, 32, 8
    if qtype == Q.Q6_K:
        n = b.shape[0]
        low6 = _nibbles(b[:, :128], 64).reshape(n, 2, 128)
        high6 = _crumbs(b[:, 128:192]).reshape(n, 2, 128)
        dl = _half(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)
        return (low6 | (high6 << 4)).reshape(n, 256), dl, -32 * dl, 16, 8
    if qtype == Q.Q2_K:
        scales = b[:, :16]
        d, dmin = _half(b[:, 80:82]), _half(b[:, 82:84])
        return (_crumbs(b[:, 16:80]), d * (scales & 0xF).astype(np.float32),
                -dmin * (scales >> 4).astype(np.float32), 16, 4)
    if qtype == Q.Q3_K:
        return _decode_q3_k(b)
    raise ValueError(f"{qtype.name} blocks have no quantized kernel")


def _decode_q3_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    n = b.shape[0]
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _half(b[:, 108:110])
    low = ((scales[:, :8].reshape(n, 1, 8) >> SHIFTS.reshape(1, 2, 1)) & 0x0F).reshape(n, 16)
    high = ((scales[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8)
             .reshape(1, 4, 1)) & 3).reshape(n, 16)
    dl = d * ((low | (high << 4)).astype(np.int8) - 32).astype(np.float32)
    qh = _bits(hmask, 8).reshape(n, 256)  # set means no -4
    return _crumbs(qs) + (qh << 2), dl, -4 * dl, 16, 4  # codes q + 4, in [0, 8)


QUANTIZED_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
                   Q.Q6_K)


def from_gguf(raw: np.ndarray, qtype: Q, rows: int) -> Blocks:
    """A GGUF tensor's bytes ([rows, bytes per row], as gguf's reader gives them) decoded.
    The kernels hold d and m as float16: exact for the types whose blocks store them so; the
    K-quants' (a float16 times a 6- or 8-bit sub-block scale) round by at most 2^-11 of
    themselves, ~40x finer than their 6-bit codes' steps. The values returned are those."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    codes, d, m, bs, bits = _decode(np.ascontiguousarray(raw).reshape(-1, size), qtype)
    return Blocks(codes.reshape(rows, -1), _float16(d).reshape(rows, -1).astype(np.float32),
                  _float16(m).reshape(rows, -1).astype(np.float32), bs, bits)


# ---- weights quantized here (--quantization)



def quantize(weight: torch.Tensor, bits: int) -> Blocks:
    """`weight` [N, K] in blocks of 32 inputs (K padded with zeros): 8 bits symmetric, as
    GGUF's Q8_0 (d = max |w| / 127, codes q + 128); 4 bits from each block's min to its max, as
    Q4_1 (d = (max - min) / 15, m = min). Codes are rounded from the float16 d and m."""
    w = weight.detach().float()
    n, k = w.shape
    w = torch.nn.functional.pad(w, (0, -k % 32)).view(n, -1, 32)
    if bits == 8:
        d = _half_of(w.abs().amax(-1) / 127)
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        codes = torch.round(w * inv[..., None]).clamp_(-127, 127) + 128
        m = -128 * d
    else:
        lo, hi = w.amin(-1), w.amax(-1)
        d, m = _half_of((hi - lo) / 15), _half_of(lo)
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        codes = torch.round((w - m[..., None]) * inv[..., None]).clamp_(0, 15)
    return Blocks(codes.to(torch.uint8).view(n, -1).numpy(), d.numpy(), m.numpy(), 32, bits, k)


def _half_of(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).float()


# ---- packing


def _pad_rows(b: Blocks, multiple: int) -> Blocks:
    extra = -b.codes.shape[0] % multiple
    if not extra:
        return b

    def pad(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a, np.zeros((extra, a.shape[1]), a.dtype)])

    return Blocks(pad(b.codes), pad(b.d), pad(b.m), b.bs, b.bits, b.n_in)


def pack(b: Blocks, gate_up: bool = False) -> torch.Tensor:
    """The bytes quant.h describes, 64-byte aligned: units of 32 rows (with gate_up, 16 gate
    rows and their 16 up rows), two groups of 16 each, each K / bs records."""
    if gate_up:
        half = b.codes.shape[0] // 2
        gate, up = _pad_rows(b.rows(slice(0, half)), GROUP), _pad_rows(b.rows(slice(half, None)), GROUP)
        order = np.stack([np.arange(0, gate.codes.shape[0]).reshape(-1, GROUP),
                          np.arange(0, gate.codes.shape[0]).reshape(-1, GROUP) + gate.codes.shape[0]],
                         1).reshape(-1)
        b = concat([gate, up]).rows(order)
    b = _pad_rows(b, UNIT)
    n, k = b.codes.shape
    groups, nb, bs = n // GROUP, k // b.bs, b.bs
    codes = b.codes.reshape(groups, GROUP, nb, bs)
    body: np.ndarray
    if b.kind == TL_Q4:  # [g, r, nb, chunk, low/high, 4] -> [g, nb, chunk, r, 4] bytes
        c = codes.reshape(groups, GROUP, nb, 4, 2, 4).transpose(0, 2, 3, 1, 5, 4)
        body = (c[..., 0] | (c[..., 1] << 4)).reshape(groups, nb, -1)
    else:  # [g, r, nb, bs / 4, 4] -> [g, nb, bs / 4, r, 4]
        body = codes.reshape(groups, GROUP, nb, bs // 4, 4).transpose(0, 2, 3, 1, 4)
        body = body.reshape(groups, nb, -1)
    scales = [_float16(v).reshape(groups, GROUP, nb).transpose(0, 2, 1).copy().view(np.uint8)
              for v in (b.d, b.m)]
    records = np.concatenate([body.astype(np.uint8), *scales], axis=2)
    out = torch.empty(records.size, dtype=torch.uint8)  # torch's allocator aligns to 64 bytes
    out.copy_(torch.from_numpy(records.reshape(-1)))
    return out


def _float16(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = v.astype(np.float16)
    if not np.isfinite(h).all():
        raise ValueError("a block scale is out of float16's range")
    return h
