#!/usr/bin/env bash
# One command for a lent GPU: funcamp's CUDA checks and benchmarks, one report.
#
#     bash benchmarks/device_check.sh [OUTDIR]     # OUTDIR default: $OUT, else build/device_check
#
# Runs, each under its own timeout (all of it in about 8 minutes on one GPU), in this order:
#   1. the CUDA tests and the        FUNCAMP_TEST_DEVICE=cuda python -m pytest -m "cuda or
#      device parity suites          device_parity" tests (tests/test_device_parity.py: amp vs
#                                    torch.autocast over torch's CUDA lists, the scaler vs
#                                    GradScaler in float16, the optimizers vs torch.optim foreach/
#                                    fused, the compiled donated step vs eager and torch.amp, FP8
#                                    on compute capability >= 8.9; the 15 slowest are listed)
#   2. the train-step benchmark      benchmarks/train_step.py --device cuda on the GPT (time per
#                                    step of torch.amp's eager step and of funcamp's: compiled,
#                                    donated, eager, and compiled with mode="reduce-overhead",
#                                    i.e. CUDA graphs where inductor allows: skips are counted)
#   3. the memory benchmark          benchmarks/memory.py --device cuda on the GPT d=512, every
#                                    variant in a fresh process (max_memory_allocated)
#   4. the FP8 benchmark             benchmarks/fp8.py --device cuda
# and writes OUTDIR/device_report.md (machine, versions, each part's status, time and output
# tail) beside the parts' logs and JSON. A part that fails or times out is reported and the next
# one runs. Exit status: 0 if every part passed, 1 if one failed, 2 without a CUDA device (found
# out first, in seconds: nothing else runs).
#
# Needs no network: funcamp is imported from this checkout (PYTHONPATH); if pytest, hypothesis or
# expecttest (torch's autocast and optimizer test lists need it) is missing it tries
# `python -m pip install -e ".[test]"` once (that needs a package index or a local wheel cache)
# and says so in the report. Set DEVICE_CHECK_BUDGET (seconds, default 465)
# to change the overall budget. Each part's limit is its share (tests 210 s, train_step 110 s,
# memory 90 s, fp8 50 s) plus whatever the parts before it left unused, capped by what is left
# of the budget.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${1:-${OUT:-$ROOT/build/device_check}}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
REPORT="$OUTDIR/device_report.md"
PY="${PYTHON:-python}"
BUDGET="${DEVICE_CHECK_BUDGET:-465}"
START=$(date +%s)
FAILED=0

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONHASHSEED=0
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$ROOT/build/inductor-cache}"
cd "$ROOT" || exit 1

say() { printf '%s\n' "$*" | tee -a "$REPORT"; }

{
  echo "# funcamp device check"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "- host: $(hostname 2>/dev/null || echo unknown)"
  echo "- funcamp revision: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- CPU: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ //')"
} >"$REPORT"

# -- 1. is there a GPU? (fast: this is the only thing that runs without one)
PROBE=$(timeout 120 "$PY" - <<'EOF' 2>&1
import torch
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}")
if not torch.cuda.is_available():
    raise SystemExit("torch.cuda.is_available() is False")
print(f"GPU: {torch.cuda.get_device_name()} ({torch.cuda.device_count()} visible)")
EOF
)
PROBE_RC=$?
printf '%s\n' "$PROBE" | sed 's/^/- /' >>"$REPORT"
if [ $PROBE_RC -ne 0 ]; then
  MSG="device_check.sh: no CUDA device: $(printf '%s' "$PROBE" | tail -n 1). This script runs funcamp's GPU checks; run it on a machine with a GPU and a CUDA build of torch."
  { echo; echo "**Not run.** $MSG"; } >>"$REPORT"
  echo "$MSG" >&2
  echo "report: $REPORT" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
  | sed 's/^/- nvidia-smi: /' >>"$REPORT"

# -- test dependencies (a bare torch machine may lack them)
if ! "$PY" -c "import pytest, hypothesis, expecttest" 2>/dev/null; then
  say ""
  say "pytest, hypothesis or expecttest is missing: running \`$PY -m pip install -e \".[test]\"\`."
  if timeout 180 "$PY" -m pip install -q -e ".[test]" >"$OUTDIR/pip_install.log" 2>&1; then
    say "Installed."
  else
    say "The install failed (no network?); the tests will fail to start: see pip_install.log."
  fi
fi

# run_part NAME SHARE_SECONDS COMMAND...: run with a timeout of min(SHARE + CARRY, what is
# left), log to OUTDIR/NAME.log, append its section to the report; CARRY is the time the parts
# before it did not use.
CARRY=0
run_part() {
  local name=$1 share=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  local allowed=$((share + CARRY))
  local limit=$((allowed < left ? allowed : left))
  {
    echo
    echo "## $name"
    echo
    echo "\`$(printf '%q ' "$@" | sed 's/ $//')\`"
    echo
  } >>"$REPORT"
  if [ "$limit" -lt 20 ]; then
    echo "**Skipped**: the budget of ${BUDGET} s is spent." >>"$REPORT"
    FAILED=1
    return
  fi
  local t0 rc status
  t0=$(date +%s)
  timeout --kill-after=15 "$limit" "$@" >"$OUTDIR/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status="passed" ;;
    124 | 137) status="**TIMED OUT** after ${limit} s" ;;
    *) status="**FAILED** (exit $rc)" ;;
  esac
  [ $rc -ne 0 ] && FAILED=1
  local used=$(($(date +%s) - t0))
  CARRY=$((allowed > used ? allowed - used : 0))
  {
    echo "Status: $status, $(($(date +%s) - t0)) s (limit ${limit} s). Output tail ($name.log):"
    echo
    echo '```'
    tail -n 60 "$OUTDIR/$name.log"
    echo '```'
  } >>"$REPORT"
  echo "device_check: $name: $status" >&2
}

# A hung test must not eat the whole share: pytest-timeout (the test extra) when it is there.
PER_TEST=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout 150)
run_part cuda_tests 210 env FUNCAMP_TEST_DEVICE=cuda "$PY" -m pytest -o addopts="" \
  -p no:cacheprovider -m "cuda or device_parity" -q -rs --durations=15 ${PER_TEST[@]+"${PER_TEST[@]}"} tests
run_part train_step 110 "$PY" benchmarks/train_step.py --device cuda --models gpt --only bde \
  --warmup 5 --iters 20 --rounds 3 --out "$OUTDIR/train_step.json"
run_part memory 90 "$PY" benchmarks/memory.py --device cuda --models gpt512 \
  --cell-timeout 80 --out "$OUTDIR/memory.json"
run_part fp8 50 "$PY" benchmarks/fp8.py --device cuda --steps 10

{
  echo
  echo "Total: $(($(date +%s) - START)) s of a ${BUDGET} s budget; $([ $FAILED -eq 0 ] && echo 'every part passed' || echo 'some part did not pass')."
} >>"$REPORT"
echo "report: $REPORT" >&2
exit $FAILED
