#!/usr/bin/env bash
# One prepared GPU run: the GPU tests, then the one-shot benchmark (benchmarks.bench_gpu), results
# under $OUT, in at most 8.5 minutes of wall time (--quick: 4 minutes; GPU_CHECK_TOTAL_S=seconds
# changes it, the benchmark gets what the tests leave).
#
#   OUT=/path/to/results bash scripts/gpu_check.sh            # tests (parallel, <= 170 s) + bench_gpu (the rest)
#   OUT=/path/to/results bash scripts/gpu_check.sh --quick    # a second, short call: env + bench_gpu --quick
#   OUT=/path/to/results bash scripts/gpu_check.sh --dry-run  # without CUDA: every step, bench_gpu --dry-run (a test runs it)
#
# Needs a Python with CUDA torch and triton (PYTHON=..., else .venv/bin/python, else python3) and no
# network. Wheels the image lacks are carried in wheels/ at the repository root (gitignored; else
# shared/wheels/), copied along with the checkout: protobuf 7.36.2 (the generated
# modules need >= 7.35.1; its abi3 wheel and its pure-Python one), fla-core and
# flash-linear-attention 0.6.0 (pure Python). A module that is
# missing (or protobuf too old) is installed from them with `pip install --no-index --no-deps`
# (unzipped when the Python has no pip) into /tmp/harts-site (protobuf: on PYTHONPATH for every
# step) or /tmp/harts-site-fla (fla: only for bench_gpu; with fla importable transformers binds
# fla's kernels even for CPU tensors, which the tests must not see); HARTS_SITE, HARTS_SITE_FLA
# change them.
#
# Writes, under $GPU_CHECK_RESULTS (default /tmp/gpu-check-results): summary.txt (one line per
# step: exit code, seconds, log), nvidia-smi.txt, wheels.txt, env.txt, tests-*.txt (pytest -v
# logs), gpu-figures.jsonl (what the trainer's GPU tests saw), bench-warm.log and warm/ (the
# warm-up beside the tests), bench.log and bench/ (bench_gpu: one JSON file per section, written as
# each ends, report.md, kernels/); and into $OUT, packed after every step and every 20 s (a few
# files, for runners that bring back only a few): results.tgz (all of it), summary.txt, report.md,
# gpu-figures.jsonl.
# Exit code: 0 when every step passed, 1 otherwise.
set -u
cd "$(dirname "$0")/.." || exit 1
MODE=${1:-full}
case "$MODE" in  # TOTAL_S: the whole script (GPU_CHECK_TOTAL_S overrides); BENCH_MAX: bench_gpu's own budget at most
  full) TOTAL_S=${GPU_CHECK_TOTAL_S:-510}; BENCH_MAX=420 ;;  # 8.5 min; 7 min: the sum of its sections' budgets
  --quick) TOTAL_S=${GPU_CHECK_TOTAL_S:-240}; BENCH_MAX=180 ;;
  --dry-run) TOTAL_S=${GPU_CHECK_TOTAL_S:-300}; BENCH_MAX=180 ;;
  *) echo "usage: OUT=DIR bash scripts/gpu_check.sh [--quick | --dry-run]" >&2; exit 2 ;;
esac
START=$SECONDS
TESTS_S=170
OUT=${OUT:-$PWD/gpu-check-out}
# Everything is written under RES; $OUT (what a runner brings back, maybe only a few files) gets a
# packed copy after every step and every 20 s (`pack`): results.tgz, summary.txt, report.md,
# gpu-figures.jsonl. A run killed by its timeout keeps what was packed last.
RES=${GPU_CHECK_RESULTS:-/tmp/gpu-check-results}
rm -rf "$RES"
mkdir -p "$RES" "$OUT"
pack() {
  local tmp="$OUT/partial-$BASHPID.tgz"
  tar -czf "$tmp" -C "$RES" . 2>/dev/null && mv -f "$tmp" "$OUT/results.tgz"
  rm -f "$tmp"
  cp -f "$RES/summary.txt" "$OUT/summary.txt" 2>/dev/null
  [ -f "$RES/bench/report.md" ] && cp -f "$RES/bench/report.md" "$OUT/report.md"
  [ -f "$RES/gpu-figures.jsonl" ] && cp -f "$RES/gpu-figures.jsonl" "$OUT/gpu-figures.jsonl"
  return 0
}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
SITE=${HARTS_SITE:-/tmp/harts-site}
FLA_SITE=${HARTS_SITE_FLA:-/tmp/harts-site-fla}
export PYTHONPATH=$PWD:$SITE
# Compiled kernels and Numba caches stay out of $OUT (it is sent back).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/harts-triton-cache}
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/harts-numba-cache}
export HARTS_AUTOTUNE=${HARTS_AUTOTUNE:-0}  # one launch config per Triton kernel: each candidate is a compilation
# cuBLAS under torch.use_deterministic_algorithms (deterministic tests and modes) needs a fixed workspace
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
unset TRITON_INTERPRET
status=0
: > "$RES/summary.txt"
( while sleep 20; do pack; done ) &
packer=$!
trap 'kill "$packer" 2>/dev/null; pack' EXIT

step() {  # step NAME TIMEOUT_S LOG COMMAND...: run under `timeout` (KILL 10 s after TERM), log to $RES/LOG
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$RES/$log" 2>&1
  local rc=$?
  # pytest's 5: no test matched this group's -k (its complement group ran them all)
  echo "$name rc=$rc seconds=$((SECONDS - t0)) log=$log" | tee -a "$RES/summary.txt"
  pack
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ]
}

WHEELS=""
for d in wheels shared/wheels; do
  if [ -d "$d" ]; then WHEELS=$d; break; fi
done
install_wheels() {  # install_wheels TARGET DIST...: from $WHEELS, without network or dependencies
  local target=$1
  shift
  mkdir -p "$target"
  if [ -z "$WHEELS" ]; then
    echo "no wheels/ or shared/wheels/ directory: cannot install $*" >> "$RES/wheels.txt"
    return 1
  fi
  if ! "$PYTHON" -m pip install --no-index --no-deps --find-links "$WHEELS" --target "$target" "$@" >> "$RES/wheels.txt" 2>&1; then
    echo "pip failed; unzipping the pure-Python wheels of $*" >> "$RES/wheels.txt"
    for dist in "$@"; do
      for whl in "$WHEELS"/"${dist//-/_}"-*-py3-none-any.whl; do
        [ -f "$whl" ] && "$PYTHON" -m zipfile -e "$whl" "$target" >> "$RES/wheels.txt" 2>&1
      done
    done
  fi
}

nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
: > "$RES/wheels.txt"
if ! "$PYTHON" -c "
import sys, google.protobuf as p
sys.exit(tuple(int(x) for x in p.__version__.split('.')[:3]) < (7, 35, 1))" >> "$RES/wheels.txt" 2>&1; then
  install_wheels "$SITE" protobuf  # pip picks the abi3 wheel (its own upb extension) where it fits
  if [ ! -d "$SITE/google/_upb" ]; then
    # the pure-Python wheel: keep it off an older protobuf's upb extension left in site-packages
    export PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python
    echo "pure-Python protobuf: PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python" >> "$RES/wheels.txt"
  fi
fi
if ! "$PYTHON" -c "import fla" >> "$RES/wheels.txt" 2>&1; then
  install_wheels "$FLA_SITE" fla-core flash-linear-attention
fi

step env 60 env.txt env PYTHONPATH="$PYTHONPATH:$FLA_SITE" "$PYTHON" -c "
import sys, torch, triton, google.protobuf
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'protobuf', google.protobuf.__version__)
cuda = torch.cuda.is_available()
assert cuda or sys.argv[1] == '--dry-run', 'torch.cuda.is_available() is False: this Python has no CUDA torch'
print('device', torch.cuda.get_device_name() if cuda else 'cpu (dry run)')
from proto.harts.v1 import plan_pb2  # the generated modules need protobuf >= 7.35.1
for mod in ('fla', 'flash_attn', 'transformers'):
    try:
        m = __import__(mod); print(mod, getattr(m, '__version__', 'importable'))
    except Exception as exc:
        print(mod, 'not importable:', type(exc).__name__, exc)
" "$MODE"
if ! grep -q "^env rc=0" "$RES/summary.txt"; then
  echo "no usable CUDA Python ($PYTHON); see env.txt and wheels.txt" | tee -a "$RES/summary.txt"
  exit 1
fi

if [ "$MODE" != --quick ]; then
  # Correctness on many shapes, one launch config per kernel: pytest processes in parallel, each
  # under its own timeout, the two older kernel files split in two complementary groups (compiling
  # dominates these runs); waited for by PID.
  PYTEST=("$PYTHON" -m pytest -v -p no:cacheprovider -rs)
  GDN=tests/kernels/test_gated_delta_rule_triton.py
  TREE=tests/kernels/test_tree_attention_triton.py
  pids=()
  step tests-gdn-bf16-misc $TESTS_S tests-gdn-bf16-misc.txt "${PYTEST[@]}" $GDN -k "not test_triton_matches_ref_fp32" & pids+=($!)
  step tests-gdn-fp32 $TESTS_S tests-gdn-fp32.txt "${PYTEST[@]}" $GDN -k test_triton_matches_ref_fp32 & pids+=($!)
  step tests-tree-bf16-misc $TESTS_S tests-tree-bf16-misc.txt "${PYTEST[@]}" $TREE -k "not test_every_backend" & pids+=($!)
  step tests-tree-fp32 $TESTS_S tests-tree-fp32.txt "${PYTEST[@]}" $TREE -k test_every_backend & pids+=($!)
  # The newer kernel files, one process each (#640: ~85 compilations), and the trainer's gpu tests
  # (figures appended to gpu-figures.jsonl); only their files are collected: the GPU Python may lack
  # the service's dependencies.
  step tests-gdn-640 $TESTS_S tests-gdn-640.txt "${PYTEST[@]}" tests/kernels/test_gated_delta_rule_triton_640.py & pids+=($!)
  step tests-invariant-tuning $TESTS_S tests-invariant-tuning.txt "${PYTEST[@]}" -m gpu \
    tests/kernels/test_batch_invariant_triton.py tests/kernels/test_triton_tuning_gpu.py & pids+=($!)
  step tests-trainer $TESTS_S tests-trainer.txt env HARTS_GPU_FIGURES="$RES/gpu-figures.jsonl" "${PYTEST[@]}" -m gpu \
    tests/trainer/test_executor_gpu.py tests/trainer/test_moe_experts.py & pids+=($!)
  known="test_gated_delta_rule_triton|test_tree_attention_triton|test_gated_delta_rule_triton_640|test_batch_invariant_triton|test_triton_tuning_gpu|test_executor_gpu|test_moe_experts"
  other=$(grep -l "mark.gpu" tests/*/test_*.py | grep -v -E "($known)\.py" | tr '\n' ' ')
  if [ -n "$other" ]; then
    # shellcheck disable=SC2086
    step tests-gpu-other $TESTS_S tests-gpu-other.txt "${PYTEST[@]}" -m gpu $other & pids+=($!)
  fi
  # Meanwhile, at a lower CPU priority: bench_gpu's throughput section alone, so that its Triton
  # kernels (TRITON_CACHE_DIR), torch.compile graphs (if any) and Numba plan checks
  # (NUMBA_CACHE_DIR) are compiled and cached before the measured run; its figures, measured beside
  # the tests, are not results (warm/).
  warm_args=(--out "$RES/warm" --sections throughput --budget-s $((TESTS_S - 25)))
  [ "$MODE" = full ] || warm_args+=("$MODE")
  step bench-warm $TESTS_S bench-warm.log env PYTHONPATH="$PYTHONPATH:$FLA_SITE" nice -n 10 "$PYTHON" -m benchmarks.bench_gpu "${warm_args[@]}" &
  warm_pid=$!
  for pid in "${pids[@]}"; do
    wait "$pid" || status=1
  done
  wait "$warm_pid"  # its exit code is in summary.txt; a warm-up cut short is no failure
fi

# The benchmark gets what is left of TOTAL_S: its own budget (the sections share it; at most
# BENCH_MAX) ends 25 s before its hard timeout (imports, the last report), which ends 10 s before TOTAL_S.
limit=$((TOTAL_S - (SECONDS - START) - 10))
budget=$((limit - 25 < BENCH_MAX ? limit - 25 : BENCH_MAX))
bench_args=(--out "$RES/bench" --budget-s "$budget")
[ "$MODE" = full ] || bench_args+=("$MODE")
if [ "$budget" -lt 60 ]; then
  echo "bench skipped: ${budget} s left of ${TOTAL_S} s" | tee -a "$RES/summary.txt"
  status=1
else
  step bench "$limit" bench.log env PYTHONPATH="$PYTHONPATH:$FLA_SITE" "$PYTHON" -m benchmarks.bench_gpu "${bench_args[@]}" || status=1
fi
echo "total seconds=$((SECONDS - START))" | tee -a "$RES/summary.txt"
exit $status
