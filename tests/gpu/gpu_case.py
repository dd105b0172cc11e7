"""What one run of gpu_check.py measures: the GPU's sizes (`gpu_case`) or the dry run's, on
the CPU (`dry_run_case`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

# Llama 3.2 1B's shape, random weights (about 1.24 B parameters, 2.5 GB in bf16).
LLAMA_1B: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
LLAMA_TOY: dict[str, Any] = {
    **LLAMA_1B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 2048}  # f_guided's tool prompt is ~740 byte tokens


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """What one run measures: the GPU's sizes or the dry run's."""

    device: str
    dtype: torch.dtype
    llama: dict[str, Any]  # the HF config of the "1B" model
    llama_dir: Path
    builtin: str
    gap_tol: float  # HF logit gap below which a different greedy token is a tie flipped
    logprob_tol: float  # our log-probability of a token against HF's
    new_tokens: int = 32
    prompt_chars: tuple[int, ...] = (7, 40, 130, 300)
    correctness_blocks: int = 26  # too few for every sequence at once: preemption
    speed_len: tuple[int, int] = (32, 128)  # prompt characters, new tokens
    speed_streams: tuple[int, ...] = (1, 32, 128)
    speed_mix: int = 64
    speed_blocks: int = 4096
    hf_batch: int = 32
    tick_tokens: int = 2048  # --max-tokens-per-tick of the speed engine
    serve_streams: int = 256
    host_streams: tuple[int, ...] = (128, 256)
    host_ticks: int = 100  # timed decode ticks per level and rep
    host_reps: int = 3
    guided_streams: int = 64
    guided_tokens: int = 256  # about the length of a constrained answer
    guided_schemas: int = 32  # random schemas asked once each: the share of valid outputs
    guided_reps: int = 2
    guided_window_s: float = 3.0
    estimate_scale: float = 1.0
    abort_args: tuple[str, ...] = ("--trials", "10", "--max-tokens", "256", "--queued", "4",
                                   "--streams", "32", "--churn-seconds", "4",
                                   "--sample-every", "0.5")

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def gpu_case() -> Case:
    return Case("cuda", torch.bfloat16, LLAMA_1B, Path("/tmp/tether-gpu-llama1b"),
                "builtin:small", gap_tol=0.25, logprob_tol=0.25)


def dry_run_case() -> Case:
    return Case("cpu", torch.float32, LLAMA_TOY, Path("/tmp/tether-gpu-check-toy"),
                "builtin:tiny", gap_tol=1e-3, logprob_tol=1e-3, new_tokens=12,
                speed_len=(8, 8), speed_streams=(1, 4, 8), speed_mix=8, speed_blocks=256,
                hf_batch=4, tick_tokens=64, serve_streams=16, host_streams=(4, 8),
                host_ticks=10, host_reps=1, guided_streams=4, guided_tokens=32,
                guided_schemas=6, guided_reps=1, guided_window_s=1.0,
                abort_args=("--trials", "3", "--max-tokens", "64", "--queued", "2",
                            "--streams", "8", "--churn-seconds", "1", "--sample-every", "0.5"))
