"""Builds, caches and calls the CPU kernels (linear.c, cpu_kernels.c, cpu_layer.c,
cpu_forward.c, cpu_attention.c, cpu_prefill.c); packs weights for them.

The shared library is compiled on first use with the system C compiler (``$CC``, else ``cc``)
for this CPU (``-march=native``) and cached under ``$TETHER_CACHE_DIR`` (else systemd's
``$CACHE_DIRECTORY``, else ``~/.cache/tether``) by a hash of the source, the flags, the
compiler and the CPU's flags, so a daemon start pays the compile (about a second) once per
machine. Without a compiler the model
keeps its torch modules (`load` returns None and says why).

It must be loaded after torch: its ``#pragma omp`` regions then bind to the libgomp that torch
already loaded and share its thread pool (``torch.set_num_threads`` applies to both).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (HERE / "linear.c", HERE / "cpu_kernels.c", HERE / "cpu_layer.c",
           HERE / "cpu_forward.c", HERE / "cpu_attention.c", HERE / "cpu_prefill.c", HERE / "quant.c",
           HERE / "bf16.c")
HEADERS = (HERE / "cpu_kernels.h", HERE / "cpu_layer.h", HERE / "vec.h", HERE / "quant.h",
           HERE / "quant_ymm.h", HERE / "bf16.h")
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-Wno-psabi"]
# The quantized and bf16 kernels' CPU tiers, each built with its own instructions whatever
# this CPU has (quant.c and bf16.c call one only where CPUID says the CPU has them); x86-64
# only. A tier the compiler cannot build is left out (its table is then missing).
_AVX512 = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl"]
TIERS = {
    "quant_avx512.c": [*_AVX512, "-mavx512vnni"],
    "quant_avxvnni.c": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
    "quant_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "bf16_avx512.c": [*_AVX512, "-mavx512bf16"],
    "bf16_amx.c": ["-mamx-tile", "-mamx-bf16"],
}
BLOCK = 32  # output rows per packed block (NB in the C source)
PAIR_STEP = 16  # a bf16 block's pairs of inputs are padded to this (PAIR_STEP in the C source)
F32, BF16 = 0, 1  # float weight and cache element types (TL_* in the C source)
STORE = 0  # a packed weight's output: plain, or act(gate) * up (GATED[act])
GATED = {"silu": 2, "gelu_pytorch_tanh": 3}
WEIGHT_TYPES = {torch.float32: F32, torch.bfloat16: BF16}
# Quantized weights (quant.h's types; daemon/model/kernels/quant_pack.py packs them): kept here,
# where nothing needs numpy, so a model without them loads without it.
TL_Q4, TL_Q8, TL_Q8_16 = 3, 4, 5
GROUP, UNIT = 16, 32  # output rows a quantized unit interleaves; rows a quantized unit holds
QUANTIZATIONS = {"int8": 8, "int4": 4}  # --quantization: bits a weight keeps
# Calls of at most this many rows take a quantized weight's activations in two terms (~15
# bits; quant.h): the weight-streaming row counts, where the second term is free. Weights of
# --quantization int8 take two at every row count (ALL_ROWS): with one term (8 bits) past two
# rows, 20 of the real model's 572 teacher-forced prefill top-1s left the float32 reference,
# with two 11, as many as float32 activations on the same weights (docs/benchmarks.md, issue
# 37), for 1.5-1.75x the time of their products at 8-512 rows. A GGUF file whose layers hold
# 8-bit codes (Q8_0) takes two at every row count too; one with 4-bit layers keeps
# TWO_TERM_ROWS, its 8-bit head included: the 4-bit goal holds with one term, and the Q4_1
# file's Q8_0 head would pay the second term at every decode batch
# (cpu_modules.py: two_term_rows).
TWO_TERM_ROWS, ALL_ROWS = 2, 2**62

_P, _I, _C, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class Weights(ctypes.Structure):
    """tl_weights of cpu_kernels.c, field for field."""

    _fields_ = [("w", _P), ("scale", _P), ("bias", _P), ("blocks", _I), ("n_in", _I),
                ("n_out", _I), ("type", ctypes.c_int32), ("mode", ctypes.c_int32),
                ("two_term_rows", _I)]


class Layer(ctypes.Structure):
    """tl_layer of cpu_layer.h, field for field."""

    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("eps", _F), ("input_norm", _P), ("post_attention_norm", _P), ("q_norm", _P),
                ("k_norm", _P), ("attn_out_norm", _P), ("mlp_out_norm", _P),
                ("qkv", Weights), ("o", Weights), ("gate_up", Weights), ("down", Weights)]


_W, _L = ctypes.POINTER(Weights), ctypes.POINTER(Layer)


class DecodeStep(ctypes.Structure):
    """tl_decode_step of cpu_forward.c, field for field."""

    _fields_ = [("layer", _L), ("k_cache", _P), ("v_cache", _P), ("rope", _I), ("scale", _F),
                ("window", _I)]


_S = ctypes.POINTER(DecodeStep)
_SIGNATURES = {  # name: (argument types, result type)
    "tl_linear": ([_P, _I, _I, _W, _P, _I], None),
    "tl_rmsnorm": ([_P, _I, _I, _P, _F, _P], None),
    "tl_decode_attention": ([_P, _I, _P, _P, _C, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I, _P],
                            None),
    "tl_prefill_attention": ([_P, _I, _I, _P, _P, _C, _P, _I, _I, _I, _I, _I, _F, _I, _P], None),
    "tl_layer_attn_in": ([_L, _P, _I, _P, _P, _P, _P, _P, _C, _P], None),
    "tl_layer_attn_out_mlp": ([_L, _P, _I, _P], None),
    "tl_layer_decode": ([_L, _P, _I, _P, _P, _P, _P, _P, _C, _P, _I, _P, _I, _F, _I, _P, _P],
                        None),
    "tl_forward_decode": ([_S, _I, _P, _I, _P, _P, _P, _C, _P, _I, _P, _I, _P, _P], None),
    "tl_quant_select": ([_C], _C),
    "tl_quant_tier_name": ([_C], ctypes.c_char_p),
    "tl_quant_set_dequant_rows": ([_I], None),
    "tl_quant_set_step_rows": ([_I], None),
    "tl_quant_set_prefetch": ([_I], None),
    "tl_quant_rows": ([_W, _P, _I, _P], None),
    "tl_bf16_select": ([_C], _C),
    "tl_bf16_tier_name": ([_C], ctypes.c_char_p),
    "tl_bf16_set_rows": ([_I], None),
}


class Kernels:
    """The loaded library, one typed ctypes function per kernel."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
            setattr(self, name.removeprefix("tl_"), fn)

    # Attribute types for mypy; each is set in __init__ from the library.
    linear: Callable[..., None]
    rmsnorm: Callable[..., None]
    decode_attention: Callable[..., None]
    prefill_attention: Callable[..., None]
    layer_attn_in: Callable[..., None]
    layer_attn_out_mlp: Callable[..., None]
    layer_decode: Callable[..., None]
    forward_decode: Callable[..., None]
    quant_select: Callable[[int], int]
    quant_tier_name: Callable[[int], bytes]
    quant_set_dequant_rows: Callable[[int], None]
    quant_set_step_rows: Callable[[int], None]
    quant_set_prefetch: Callable[[int], None]
    quant_rows: Callable[..., None]
    bf16_select: Callable[[int], int]
    bf16_tier_name: Callable[[int], bytes]
    bf16_set_rows: Callable[[int], None]


_loaded: Kernels | None = None
_failure: str | None = None


def load() -> Kernels | None:
    """The kernels, compiled and loaded once per process; None (and a warning) if impossible."""
    global _loaded, _failure
    if _loaded is None and _failure is None:
        try:
            _loaded = Kernels(_build())
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            _failure = str(e)
            log.warning("CPU kernels unavailable, using torch ops: %s", e)
    return _loaded


def failure() -> str | None:
    return _failure


def cache_dir() -> Path:
    # CACHE_DIRECTORY: systemd's CacheDirectory= (the daemon unit's home is read-only).
    env = os.environ.get("TETHER_CACHE_DIR") or os.environ.get("CACHE_DIRECTORY")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tether"


def c_compiler() -> str:
    """`$CC`, else `cc`; RuntimeError when it is not on the PATH."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler ({compiler!r} not found; set CC)")
    return compiler


def _build(arch: str = "native") -> Path:
    """The library for `-march=arch` (tests build other vector widths), compiled if needed."""
    compiler = c_compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    units = [(src, [*FLAGS, f"-march={arch}"]) for src in SOURCES]
    if platform.machine() in ("x86_64", "AMD64"):
        units += [(HERE / name, [*FLAGS, "-march=x86-64", *flags]) for name, flags in TIERS.items()]
    texts = [f.read_text() for f in (*SOURCES, *HEADERS, *(src for src, _ in units))]
    key = hashlib.sha256("\0".join([*texts, *(" ".join(f) for _, f in units), version,
                                    platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_kernels-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: daemons starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = _compile(compiler, units, Path(tmp))
        done = subprocess.run([compiler, "-shared", "-fopenmp", *map(str, objects), "-o",
                               f"{tmp}/lib.so"], capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed on the CPU kernels: "
                               f"{done.stderr.strip()[-2000:]}")
        os.replace(f"{tmp}/lib.so", target)
    log.info("compiled CPU kernels into %s", target)
    return target


def _compile(compiler: str, units: list[tuple[Path, list[str]]], out: Path) -> list[Path]:
    """One object per source, compiled side by side; a tier's failure leaves the tier out."""
    jobs = [(src, out / f"{src.stem}.o") for src, _ in units]
    procs = [subprocess.Popen([compiler, *flags, "-c", str(src), "-o", str(obj)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for (src, flags), (_, obj) in zip(units, jobs, strict=True)]
    objects = []
    for (src, obj), proc in zip(jobs, procs, strict=True):
        _, err = proc.communicate(timeout=300)
        if proc.returncode == 0:
            objects.append(obj)
        elif src.name in TIERS:
            log.warning("%s cannot build %s; that tier is left out: %s", compiler, src.name,
                        err.strip()[-500:])
        else:
            raise RuntimeError(f"{compiler} failed on the CPU kernels: {err.strip()[-2000:]}")
    return objects


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


# ---- packing


def pack(weight: Tensor, gate_up: bool = False) -> Tensor:
    """[N, K] -> [ceil(N / 32), K, 32], zero rows padding N; bfloat16 in pairs of inputs,
    [ceil(N / 32), K2, 32, 2] with K2 = ceil(K / 2) padded to PAIR_STEP by zero inputs (the
    operand of the bf16 products, which read it in place; cpu_kernels.h). With gate_up the two
    halves of weight (gate rows, then up rows) are interleaved 16 by 16, so that each block
    holds 16 gate rows and their 16 up rows and the kernel can write silu(gate) * up."""
    if gate_up:
        gate, up = weight.chunk(2)
        half = BLOCK // 2
        gate, up = _pad_rows(gate, half), _pad_rows(up, half)
        n_in = gate.shape[1]
        weight = torch.stack([gate.view(-1, half, n_in), up.view(-1, half, n_in)], 1)
        weight = weight.reshape(-1, n_in)
    weight = _pad_rows(weight, BLOCK)
    n, k = weight.shape
    blocks = weight.view(n // BLOCK, BLOCK, k).transpose(1, 2)
    if weight.dtype != torch.bfloat16:
        return blocks.contiguous()
    pairs = -(-k // 2 // PAIR_STEP) * PAIR_STEP  # ceil(ceil(k / 2) / PAIR_STEP) steps
    blocks = torch.nn.functional.pad(blocks, (0, 0, 0, 2 * pairs - k))
    return blocks.view(n // BLOCK, pairs, 2, BLOCK).transpose(2, 3).contiguous()


def pack_vector(values: Tensor, gate_up: bool = False) -> Tensor:
    """A per-row vector (bias, scale) in the order `pack` puts the rows in, as float32."""
    return pack(values.float()[:, None], gate_up).flatten().contiguous()


def unpack_rows(packed: Tensor, rows: Tensor, n_in: int) -> Tensor:
    """Rows `rows` of the weight `pack` was given (no gate_up): [len(rows), n_in]."""
    if packed.dim() == 3:
        return packed[rows // BLOCK, :, rows % BLOCK]
    return packed[rows // BLOCK, :, rows % BLOCK, :].flatten(1)[:, :n_in]


def _pad_rows(weight: Tensor, multiple: int) -> Tensor:
    extra = -weight.shape[0] % multiple
    if not extra:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])])
