#!/usr/bin/env bash
# The CUDA path proven on one GPU in one call (tests/gpu/gpu_check.py says what it checks).
#
#   bash tests/gpu/run.sh               # on the device machine: wheels from .whl, JSON to $OUT
#   bash tests/gpu/run.sh --dry-run     # here, on the CPU: builtin:tiny and toy sizes
#
# The wall budget (GPU_CHECK_BUDGET_S, 330 s) starts after the wheel install; sections that
# would not fit in what is left are skipped with a note. Writes $OUT/<section>.json,
# $OUT/summary.json and $OUT/log.txt; prints a table last.
# .whl holds what the device's Python lacks (llguidance for the daemon; jsonschema and its
# attrs, referencing, rpds-py, jsonschema-specifications for f_guided).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d /tmp/gpu-check-XXXXXX)}
mkdir -p "$OUT"
if [ "${1:-}" = "--dry-run" ]; then
    PY=${PYTHON:-python3}
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    BUDGET=${GPU_CHECK_BUDGET_S:-900}
else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
    PY=python3
    BUDGET=${GPU_CHECK_BUDGET_S:-330}
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm \
        --format=csv 2>&1 | tee "$OUT/log.txt"
fi
export PYTHONUNBUFFERED=1 GPU_CHECK_T0=${GPU_CHECK_T0:-$(date +%s.%N)}
export TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
set -o pipefail
"$PY" tests/gpu/gpu_check.py --out "$OUT" --budget-s "$BUDGET" "$@" 2>&1 | tee -a "$OUT/log.txt"
