"""Compiled kernels behind the model's module boundaries, chosen per device at load time.

CPU: linear.c (every linear's entry), cpu_kernels.c (weight-streaming linears over packed
weights), cpu_layer.c (norms, RoPE, a layer's calls), cpu_attention.c and cpu_prefill.c
(decode and prefill attention over the paged cache), quant.c with its CPU tiers (quantized
weights times int8 activations) and bf16.c with its (bf16 products), built with the system
compiler on first use. CUDA: a Triton kernel for decode attention over the paged cache
(triton_attention.py); the linears stay cuBLAS's. With
``kernels="torch"`` the model keeps the torch reference modules of daemon/model/decoder.py everywhere.
"""

from __future__ import annotations

import logging

import torch

from daemon.model.decoder import DecoderLM

log = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "torch")


def install(model: DecoderLM, device: torch.device, kernels: str = "auto",
            quantization: str | None = None) -> str:
    """Swap kernels into `model`; returns which ones it now runs: 'cpu', 'triton' or 'torch'.

    Raises ValueError for a combination that cannot run (weights quantized by --quantization
    without the CPU kernels)."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"--kernels must be one of {', '.join(KERNEL_CHOICES)}, got {kernels!r}")
    ranks = model.embed_tokens.group.size
    if device.type == "cpu" and kernels == "auto" and ranks > 1:
        # A fused CPU layer would skip the row-parallel linears' all-reduce.
        reason = f"the CPU kernels run one rank, not {ranks}"
    elif device.type == "cpu" and kernels == "auto" and model.dtype != torch.float16:
        from daemon.model.kernels import cpu, cpu_modules

        lib = cpu.load()
        if lib is not None:
            cpu_modules.install_(model, lib, quantization)
            return "cpu"
        reason = f"the CPU kernels are unavailable: {cpu.failure()}"
    elif device.type == "cuda" and kernels == "auto":
        from daemon.model.kernels.triton_attention import available, install_

        if available():
            install_(model)
            reason = "quantized weights are a CPU kernel option"
            if quantization is None:
                return "triton"
            raise ValueError(f"--quantization {quantization}: {reason}")
        reason = "Triton is not installed"
    else:
        reason = f"kernels={kernels!r}, device {device.type}, dtype {model.dtype}"
    _dequantize_kept_(model)
    if quantization is not None:
        raise ValueError(f"--quantization {quantization} needs the CPU kernels ({reason})")
    return "torch"


@torch.no_grad()
def _dequantize_kept_(model: DecoderLM) -> None:
    """The weights a GGUF file held quantized, into the torch modules' parameters (the kernels
    that would have computed on them do not run)."""
    params = dict(model.named_parameters())
    for name, blocks in model.quantized.items():
        params[name].copy_(torch.from_numpy(blocks.dequantized()))
    model.quantized.clear()
