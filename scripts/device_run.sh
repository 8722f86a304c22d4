#!/usr/bin/env bash
# One device session: GPU tests, sanitizer subset, benchmark. Logs under $OUT.
# Usage (on the GPU machine, repository root): bash scripts/device_run.sh [pytest args]
set -u
OUT=${OUT:-/tmp/cupy_act_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q -x -p no:cacheprovider tests "$@" 2>&1 | tee "$OUT/pytest.log" | tail -n 30
python3 scripts/bench.py 2>&1 | tee "$OUT/bench.log" | tail -n 25
