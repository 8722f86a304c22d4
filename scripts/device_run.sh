#!/usr/bin/env bash
# One GPU session: full test suite, a reduced suite under compute-sanitizer,
# the benchmark suite (tables, JSON, CSV, plot under $OUT/bench) and the
# call-overhead table. Logs go to $OUT; a summary is last.
# Usage (GPU machine, repository root): [TUNE=1] bash scripts/device_run.sh
set -u
OUT=${OUT:-/tmp/cupy_act_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" >> "$OUT/gpu.txt"

timeout 330 python3 -m pytest -q -p no:cacheprovider tests -rs > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest.log"
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider \
  tests/test_ops_gpu.py -k "contiguous-33- or misaligned-129- or step2-31- or transposed-4097- or (test_bias_bit_exact and not large)" \
  > "$OUT/sanitizer.log" 2>&1
echo "sanitizer rc=$?" >> "$OUT/sanitizer.log"
timeout 330 python3 scripts/bench.py --out "$OUT/bench" > "$OUT/bench.log" 2>&1
timeout 60 python3 scripts/overhead.py > "$OUT/overhead.log" 2>&1
if [ "${TUNE:-0}" = 1 ]; then  # launch-shape sweep (development)
  timeout 240 python3 scripts/tune.py > "$OUT/tune.log" 2>&1
fi

echo "== summary"; cat "$OUT/gpu.txt"
tail -n 3 "$OUT/pytest.log"; grep -E "^FAILED|^ERROR" "$OUT/pytest.log" | head -20
grep -E "ERROR SUMMARY|passed|failed|rc=" "$OUT/sanitizer.log" | tail -n 4
grep -E "^  (PASS|MISS)|targets met|conv" "$OUT/bench.log"; tail -n 9 "$OUT/overhead.log"
[ -f "$OUT/tune.log" ] && cat "$OUT/tune.log"
