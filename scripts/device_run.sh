#!/usr/bin/env bash
# One device run: the conformance suite (every row in a fresh subprocess), the
# rest of the GPU tests, every kernel family under compute-sanitizer (memcheck
# and initcheck with the caching allocators off; racecheck), the deliberate
# kernel bugs (tests/mutants.py), the benchmark suite (tables, JSON, CSV, plot
# under $OUT/bench) and the call-overhead table.
# Logs go to $OUT; a summary is last.
# Usage (GPU machine, repository root):
#   [PARTS="conformance tests sanitizer racecheck mutants bench overhead selfcheck cold cpu models
#           kernelbench convbench"] \
#     [BASE=dir] [OVERHEAD_RUNS=2] [CPU_RUNS=1] \
#     [TUNE=1] \
#     bash scripts/device_run.sh
# The conformance rows run in groups beside the tests, over two GPUs where
# there are two (see below), and the 2-GPU rows after them.
# BASE: a copy of another version's cupy_act/ and cuda/ (e.g. the last release),
# whose overhead is measured in the same run, alternating with this one (and
# its CPU path too, where the copy has its scripts/).
set -u
OUT=${OUT:-/tmp/cupy_act_out}; mkdir -p "$OUT"
PARTS=${PARTS:-"conformance tests sanitizer bench overhead"}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
has() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" >> "$OUT/gpu.txt"

PYTEST="python3 -m pytest -q -p no:cacheprovider -rs --durations=25"
CONF=tests/test_conformance.py
CONV="tests/test_conv.py tests/test_conv_wgrad.py tests/test_conv_dgrad.py tests/test_compile_route.py"
GPUS=$(nvidia-smi -L | wc -l)
# Conformance rows are fresh processes, the compile rows 20-30 s each: one
# after another they ran past 400 s, so they run in groups side by side (the
# first-use rows, then the compile modes; the rest; the 2-GPU rows last, with
# every GPU visible), beside the tests (the convolution's files and the rest).
# With 2 or more GPUs, the second takes the third group; the first group and
# the tests outside the convolution's files see every GPU (rows on cuda:1,
# 2-GPU tests).
G1="first_backward or new_thread or threads or cache_dir or private or func_ or forward_ad"
G2="compile_default or compile_reduce_overhead or compile_max_autotune or compile_kernels_route"
G3="compile_dynamic or compile_training_step or cuda_graph or checkpoint or autocast or export"
G3="$G3 or no_grad or inference_mode or deterministic or grad_only_on_bias or side_stream"
G4="ddp or fsdp2 or second_device or sync_batchnorm"
B=$([ "$GPUS" -ge 2 ] && echo 1 || echo 0)
IGNORE=""; for f in $CONF $CONV; do IGNORE="$IGNORE --ignore=$f"; done
if has conformance; then
  ( timeout 300 $PYTEST $CONF -k "not cpu and ($G1)" > "$OUT/conf_g1.log" 2>&1
    echo "rc=$?" >> "$OUT/conf_g1.log"
    CUDA_VISIBLE_DEVICES=0 timeout 300 $PYTEST $CONF -k "not cpu and ($G2)" > "$OUT/conf_g2.log" 2>&1
    echo "rc=$?" >> "$OUT/conf_g2.log" ) &
  ( CUDA_VISIBLE_DEVICES=$B timeout 400 $PYTEST $CONF -k "not cpu and ($G3)" > "$OUT/conf_g3.log" 2>&1
    echo "rc=$?" >> "$OUT/conf_g3.log" ) &
fi
if has tests; then
  # (the GPU tests: CI runs the others)
  ( CUDA_VISIBLE_DEVICES=0 timeout 400 $PYTEST -m gpu $CONV > "$OUT/pytest_conv.log" 2>&1
    echo "rc=$?" >> "$OUT/pytest_conv.log" ) &
  # (every GPU visible: its 2-GPU tests)
  ( timeout 400 $PYTEST -m gpu tests $IGNORE > "$OUT/pytest.log" 2>&1
    echo "rc=$?" >> "$OUT/pytest.log" ) &
fi
if has mutants; then  # the deliberate kernel bugs of tests/mutants.py, each to be caught
  ( timeout ${MUTANTS_TIMEOUT:-450} python3 scripts/mutants.py --kind gpu --json "$OUT/mutants_gpu.json" \
      > "$OUT/mutants_gpu.log" 2>&1
    echo "rc=$?" >> "$OUT/mutants_gpu.log" ) &
fi
wait
if has conformance; then
  timeout 200 $PYTEST $CONF -k "not cpu and ($G4)" > "$OUT/conf_g4.log" 2>&1
  echo "rc=$?" >> "$OUT/conf_g4.log"
fi
if has sanitizer; then
  # compute-sanitizer sees an access past a tensor only where the tensor is an
  # allocation of its own: PyTorch's caching allocator and CuPy's memory pool
  # off (CUPY_ACT_NO_POOL: tests/conftest.py) in every group but "graphs",
  # whose CUDA-graph captures need the caching allocator. Groups run side by side.
  san() {  # san LOG TOOL [ENV...] -- PYTEST ARGS...: one group, its exit status last in its log
    local log=$OUT/$1.log tool=$2; shift 2
    local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    timeout 480 env "${envs[@]}" compute-sanitizer --tool "$tool" --error-exitcode 99 \
      python3 -m pytest -q -p no:cacheprovider "$@" > "$log" 2>&1
    echo "rc=$?" >> "$log"
  }
  NC=(PYTORCH_NO_CUDA_MEMORY_CACHING=1 CUPY_ACT_NO_POOL=1)
  # elementwise: whole vectors, single elements, strided views, > 2^16 elements, a bias
  EW="contiguous-33- or misaligned-129- or step2-31- or transposed-4097- or (test_bias_bit_exact and not large)"
  san san_elementwise memcheck "${NC[@]}" -- tests/test_ops_gpu.py tests/test_torch_adapter.py \
    -k "$EW or (cuda and (bias_forward or mask_bit_order))" &
  # BatchNorm forward and backward, both layouts (and an unaligned one), both memory modes
  san san_batchnorm memcheck "${NC[@]}" -- tests/test_batchnorm.py \
    -k "nchw_reductions or running or (accuracy and float32 and (40 or 24)) or save_a_mask" &
  # the forward with a shortcut added after the activation (compiled graphs' post)
  san san_bn_post memcheck "${NC[@]}" -- tests/test_batchnorm_folding.py -k post_equals &
  # BatchNorm's backward reading a channel slice of dy where it lies (both layouts,
  # aligned and not, both memory modes)
  san san_bn_layouts memcheck "${NC[@]}" -- tests/test_batchnorm_layouts.py \
    -m gpu -k "channel_slice_equals and float32" &
  # the fused convolution: masks over broken and whole words, both layouts, odd shapes,
  # the row seams, y at every offset in a 16-byte unit, strided inputs, the
  # training forward's mask zeroed by a driver call, the tensor-map paths (sm_90a)
  CV="mask_decodes or empty_batch or odd_patch or (accuracy and (case3- or case17-)) or dilation"
  CV="$CV or (wide_outputs and (wide0 or wide3 or wide4) and dtype0-fused-) or (staged and (dtype0 or dtype2))"
  CV="$CV or row_seams or where_y_starts or strided_views or poisoned_memory"
  san san_conv memcheck "${NC[@]}" -- tests/test_conv.py -k "$CV" &
  # the weight gradient: partial tiles, both layouts, empty batch, many splits,
  # bulk and tensor copies, the sm_90a warpgroup kernel, unaligned dy
  WG="(accuracy and (case3- or case17-)) or non_finite or empty or repeats or unaligned"
  WG="$WG or ((wide1 or wide3 or wide4) and dtype0-fused-) or ((bulk0 or bulk1 or bulk2) and dtype0-fused)"
  WG="$WG or ((bulk3 or bulk4) and dtype2) or (warpgroup and (wg2 or wg3 or wg4) and dtype0 and not tf32)"
  WG="$WG or (warpgroup and wg0 and dtype2) or (tensor_copies and dtype0)"
  san san_wgrad memcheck "${NC[@]}" -- tests/test_conv_wgrad.py -k "$WG" &
  # the input gradient: odd shapes, column tiles, runs of rows over image edges, unaligned dy
  DG="(accuracy and (case0- or case5- or case9-) and dtype0-fused-) or non_finite or unaligned or empty"
  DG="$DG or ((wide1 or wide2 or wide4) and dtype0-fused-) or staged_and_plain"
  san san_dgrad memcheck "${NC[@]}" -- tests/test_conv_dgrad.py -k "$DG" &
  # every entry point given mismatched tensors (the mismatch table's CUDA cases)
  san san_mismatch memcheck "${NC[@]}" -- tests/test_mismatched_inputs.py -m gpu &
  # SyncBatchNormAct2d's local and synchronized passes (two processes, gloo on one GPU):
  # a rank with batch 1 and one with none, both layouts and memory modes
  san san_sync memcheck "${NC[@]}" SYNC_WORKER_SHAPES=2 -- tests/test_syncbatchnorm.py \
    -m gpu -k kernels &
  # initcheck where buffers are zeroed or filled for a kernel: masks (elementwise,
  # the convolution's training forward), the weight gradient's split partials,
  # BatchNorm's counters and partial sums
  san init_masks initcheck "${NC[@]}" -- tests/test_ops_gpu.py tests/test_conv.py \
    -k "contiguous-33- or misaligned-129- or poisoned_memory or (mask_decodes and float32)" &
  san init_wgrad initcheck "${NC[@]}" -- tests/test_conv_wgrad.py \
    -k "(accuracy and (case3- or case17-) and dtype0-fused-) or repeats" &
  san init_batchnorm initcheck "${NC[@]}" -- tests/test_batchnorm.py \
    -k "nchw_reductions or (accuracy and float32 and 40 and contiguous)" &
  # CUDA graphs: captures need the caching allocator, so it stays on here
  san san_graphs memcheck -- tests/test_batchnorm.py tests/test_conv.py tests/test_torch_cuda.py \
    -k "cuda_graph" &
  wait
  # The control: with the checks taken out (two mutants, tests/mutants.py), the
  # mismatched BatchNorm reads past its buffers, and memcheck must say so.
  san san_control memcheck "${NC[@]}" CUPY_ACT_MUTANT=bn_channel_check_dropped,launcher_checks_dropped \
    -- tests/test_mismatched_inputs.py -k "cuda and mismatch and channels_32-train-default"
fi
if has racecheck; then
  # the forward's tile in shared memory read back by other warps: the epilogue
  # tile (mma.sync) or the mask words and the bias (sm_90a), and the rows
  # staged by cp.async for the next tile (sm_90a); the weight and input
  # gradients' shared tiles; BatchNorm's block reductions
  timeout 200 compute-sanitizer --tool racecheck --kernel-name kns=conv2d_kernel --error-exitcode 99 \
    python3 -m pytest -q -p no:cacheprovider tests/test_conv.py -k "(mask_decodes and float32) or (staged0 and dtype0)" \
    > "$OUT/racecheck.log" 2>&1
  echo "rc=$?" >> "$OUT/racecheck.log"
  timeout 300 compute-sanitizer --tool racecheck --kernel-name kns=conv2d_wgrad --error-exitcode 99 \
    python3 -m pytest -q -p no:cacheprovider tests/test_conv_wgrad.py -k "((wide1 or wide3 or case3-) and dtype0-fused-) or (bulk2 and dtype0-fused) or (warpgroup and (wg2 or wg4) and dtype0 and not tf32)" \
    >> "$OUT/racecheck.log" 2>&1
  echo "rc=$?" >> "$OUT/racecheck.log"
  timeout 300 compute-sanitizer --tool racecheck --kernel-name kns=conv2d_dgrad --error-exitcode 99 \
    python3 -m pytest -q -p no:cacheprovider tests/test_conv_dgrad.py -k "(wide1 or case5-) and dtype0-fused-" \
    >> "$OUT/racecheck.log" 2>&1
  echo "rc=$?" >> "$OUT/racecheck.log"
  timeout 200 compute-sanitizer --tool racecheck --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider \
    tests/test_batchnorm.py -k "nchw_reductions" >> "$OUT/racecheck.log" 2>&1
  echo "rc=$?" >> "$OUT/racecheck.log"
  # (the channels-last reductions' per-channel trees in shared memory)
  timeout 200 compute-sanitizer --tool racecheck --kernel-name kns=bn_reduce --error-exitcode 99 \
    python3 -m pytest -q -p no:cacheprovider tests/test_batchnorm.py \
    -k "accuracy and float32 and channels_last and (24 or 64)" >> "$OUT/racecheck.log" 2>&1
  echo "rc=$?" >> "$OUT/racecheck.log"
fi
if has bench; then
  timeout ${BENCH_TIMEOUT:-330} python3 scripts/bench.py --out "$OUT/bench" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
fi
# alternate LOG LIMIT RUNS command...: RUNS rounds of the command under BASE's
# package (where BASE is set), then under this version's, appended to $OUT/LOG.
alternate() {
  local log=$OUT/$1 limit=$2 runs=$3
  shift 3
  for i in $(seq "$runs"); do
    if [ -n "${BASE:-}" ]; then
      echo "== base run $i" >> "$log"
      PYTHONPATH=$PWD/$BASE timeout "$limit" "$@" >> "$log" 2>&1
    fi
    echo "== this version, run $i" >> "$log"
    timeout "$limit" "$@" >> "$log" 2>&1
  done
}
if has overhead; then
  alternate overhead.log 90 "${OVERHEAD_RUNS:-2}" python3 scripts/overhead.py ${OVERHEAD_ARGS:-}
fi
if has selfcheck; then  # python -m cupy_act: every kernel bit for bit, and a short benchmark
  timeout 150 python3 -m cupy_act > "$OUT/selfcheck.log" 2>&1
  echo "selfcheck rc=$?" >> "$OUT/selfcheck.log"
fi
if has cold; then
  timeout 120 python3 scripts/cold_start.py > "$OUT/cold.log" 2>&1
fi
if has cpu; then  # with BASE, alternating with BASE's own scripts/cpu_path.py
  for i in $(seq ${CPU_RUNS:-1}); do
    if [ -n "${BASE:-}" ] && [ -f "$BASE/scripts/cpu_path.py" ]; then
      echo "== base run $i" >> "$OUT/cpu_path.log"
      PYTHONPATH=$PWD/$BASE timeout 120 python3 "$BASE/scripts/cpu_path.py" >> "$OUT/cpu_path.log" 2>&1
    fi
    echo "== this version, run $i" >> "$OUT/cpu_path.log"
    timeout 120 python3 scripts/cpu_path.py >> "$OUT/cpu_path.log" 2>&1
  done
fi
if has kernelbench; then  # the KernelBench seed problems with KernelBench's protocol
  timeout 300 python3 scripts/kernelbench.py --json "$OUT/kernelbench.json" > "$OUT/kernelbench.log" 2>&1
fi
if has convbench; then  # every conv2d_div_leaky_relu algorithm at five shapes
  timeout ${CONV_TIMEOUT:-540} python3 scripts/conv_bench.py ${CONV_ARGS:-} --json "$OUT/conv.json" \
    --markdown "$OUT/conv.md" > "$OUT/conv.log" 2>&1
fi
if has models; then  # training real models: eager, floor, ours, compiled (slow: compiles)
  timeout ${MODELS_TIMEOUT:-540} python3 scripts/models.py --json "$OUT/models.json" ${MODELS_ARGS:-} \
    > "$OUT/models.log" 2>&1
fi
if [ "${TUNE:-0}" = 1 ]; then  # launch-shape sweep (development)
  timeout 240 python3 scripts/tune.py > "$OUT/tune.log" 2>&1
fi

echo "== summary"; cat "$OUT/gpu.txt"
for f in conf_g1 conf_g2 conf_g3 conf_g4 pytest_conv pytest; do
  [ -f "$OUT/$f.log" ] && { echo "-- $f"; grep -E "passed|failed|rc=" "$OUT/$f.log" | tail -n 2;
    grep -E "^FAILED|^ERROR" "$OUT/$f.log" | head -20; }
done
for f in "$OUT"/san_*.log "$OUT"/init_*.log "$OUT"/racecheck.log; do
  [ -f "$f" ] && { echo "-- $(basename "$f" .log)"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|rc=" "$f" | tail -n 8; }
done
[ -f "$OUT/mutants_gpu.log" ] && sed -n '/^| mutant/,$p' "$OUT/mutants_gpu.log"
[ -f "$OUT/conv.log" ] && grep -E "fwd|PASS|MISS" "$OUT/conv.log"
[ -f "$OUT/bench.log" ] && grep -E "^  (PASS|MISS)|targets met|conv" "$OUT/bench.log"
[ -f "$OUT/overhead.log" ] && grep -E "^==|fwd|floor|in place|_relu|anchors" "$OUT/overhead.log"
[ -f "$OUT/selfcheck.log" ] && grep -E "passed|FAILED|MISMATCH|copy|cupy_act |torch |rc=" "$OUT/selfcheck.log"
[ -f "$OUT/cold.log" ] && cat "$OUT/cold.log"
[ -f "$OUT/cpu_path.log" ] && cat "$OUT/cpu_path.log"
[ -f "$OUT/tune.log" ] && cat "$OUT/tune.log"
[ -f "$OUT/models.log" ] && tail -n 15 "$OUT/models.log"
[ -f "$OUT/kernelbench.log" ] && tail -n 12 "$OUT/kernelbench.log"
exit 0
