#!/usr/bin/env bash
# One prepared GPU check of the kernels: their tests on CUDA (fp32 and bf16, every gpu-marked test)
# and the kernel benchmark report, in under 8 minutes, results under $OUT.
#
#   OUT=/path/to/results bash scripts/gpu_check.sh        # from the repository root
#
# Needs a Python with CUDA torch and triton (PYTHON=..., else .venv/bin/python, else python3);
# fla and flash_attn are optional (their rows say "not importable"). Installs nothing and needs
# no network. Writes: summary.txt (one line per step and its exit code), env.txt, nvidia-smi.txt,
# tests-*.txt (pytest -v logs), bench.log, kernels-gpu.md, kernels-gpu.json.
# Exit code: 0 when every step passed, 1 otherwise.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH=$PWD
# Compiled kernels stay out of $OUT (it is sent back).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/harts-triton-cache}
unset TRITON_INTERPRET
status=0
: > "$OUT/summary.txt"

step() {  # step NAME TIMEOUT_S LOG COMMAND...
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0)) log=$log" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
step env 60 env.txt "$PYTHON" -c "
import torch, triton
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)
assert torch.cuda.is_available(), 'torch.cuda.is_available() is False: this Python has no CUDA torch'
print('device', torch.cuda.get_device_name())
for mod in ('fla', 'flash_attn'):
    try:
        __import__(mod); print(mod, 'importable')
    except Exception as exc:
        print(mod, 'not importable:', type(exc).__name__, exc)
"
if ! grep -q "^env rc=0" "$OUT/summary.txt"; then
  echo "no usable CUDA Python ($PYTHON); see env.txt" | tee -a "$OUT/summary.txt"
  exit 1
fi
# Correctness on many shapes, one launch config per kernel (each autotune candidate is a
# compilation, and compiling dominates these runs): five pytest processes in parallel, each under
# its own timeout, the bf16 production-shape tests in the first and third.
PYTEST=("$PYTHON" -m pytest -v -p no:cacheprovider -rs)
GDN=tests/kernels/test_gated_delta_rule_triton.py
TREE=tests/kernels/test_tree_attention_triton.py
step tests-gdn-bf16-misc 210 tests-gdn-bf16-misc.txt env HARTS_AUTOTUNE=0 "${PYTEST[@]}" $GDN -k "not test_triton_matches_ref_fp32" &
step tests-gdn-fp32 210 tests-gdn-fp32.txt env HARTS_AUTOTUNE=0 "${PYTEST[@]}" $GDN -k test_triton_matches_ref_fp32 &
step tests-tree-bf16-misc 210 tests-tree-bf16-misc.txt env HARTS_AUTOTUNE=0 "${PYTEST[@]}" $TREE -k "not test_every_backend" &
step tests-tree-fp32 210 tests-tree-fp32.txt env HARTS_AUTOTUNE=0 "${PYTEST[@]}" $TREE -k test_every_backend &
# The other gpu-marked tests (only their files are collected: the GPU Python may lack service deps).
marked=$(grep -l "mark.gpu" tests/*/test_*.py | grep -v -e test_gated_delta_rule_triton -e test_tree_attention_triton | tr '\n' ' ')
if [ -n "$marked" ]; then
  # shellcheck disable=SC2086
  step tests-gpu-marked 210 tests-gpu-marked.txt env HARTS_AUTOTUNE=0 "${PYTEST[@]}" -m gpu $marked &
fi
wait
grep -q " rc=[^0]" "$OUT/summary.txt" && status=1
# The report: autotuned kernels; shapes still pending after --budget-s are listed as skipped.
step bench 210 bench.log "$PYTHON" -m benchmarks.bench_kernels --gpu --out "$OUT" --budget-s 140
exit $status
