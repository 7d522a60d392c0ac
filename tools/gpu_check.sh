#!/usr/bin/env bash
# Everything to check on a GPU machine, in one command, with one report:
#
#   tools/gpu_check.sh                      # from anywhere; runs in the repository root
#   OUT=$OUT SKIP_CPU_TESTS=1 tools/gpu_check.sh
#
# 1. the machine (nvidia-smi) and the versions (Python, torch and its CUDA and NCCL, nvcc);
# 2. builds the extension in place: $PYTHON setup.py build_ext --inplace -j $JOBS (timed);
# 3. what was built: torch_chainermn._C.cuda_built, its NCCL version, and which libnccl it links;
# 4. the CUDA tests: $PYTHON -m pytest -m cuda -v (they skip without a GPU);
# 5. a few quick CPU tests (tests/test_threads.py tests/test_torch_hooks.py tests/test_mean.py);
# 6. the GPU benchmark, when benchmarks/gpu.py exists and there is a GPU: benchmarks/gpu.py --out DIR.
#
# Writes $OUT/gpu-report.md (the machine, versions, date, build time, each pytest's summary line and
# failures, the benchmark's table) with every step's log next to it. The report is rewritten after
# every step, so a run cut short (a time limit) still leaves what it got that far. A failing step is
# recorded and the next one runs anyway; the exit status is 1 when any step failed.
#
# Environment:
#   PYTHON          the interpreter (default python3): a CUDA torch, pytest, setuptools, ninja
#   OUT             where the report and logs go (default reports/)
#   JOBS            parallel compiles for the build (default 16)
#   SKIP_BUILD=1    use the extension already built in place
#   SKIP_CPU_TESTS=1, SKIP_BENCH=1   leave those steps out
#   TEST_TIMEOUT    seconds for each pytest run (default 1500); then pytest is interrupted (SIGINT)
#                   and still prints its summary
#   BENCH_TIMEOUT   seconds for the benchmark (default 900)
#   PYTEST_ARGS     more arguments for the CUDA pytest run, as shell words: -x, or -k "hooks or parallel"
#
# No internet is needed: the build runs setup.py directly, as the GPU machines' instructions say.
# `pip install --no-build-isolation -e .` works offline too (pyproject.toml declares the build, and
# without isolation pip fetches nothing); CI installs that way.
set -uo pipefail  # no -e: every step runs, and its failure is recorded

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo" || exit 2
PYTHON=${PYTHON:-python3}
OUT=${OUT:-reports}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
REPORT="$OUT/gpu-report.md"
STARTED=$(date -u '+%Y-%m-%d %H:%M:%S UTC')

# One row per step: name, result ("ok", "FAILED (exit N)", "skipped: why"), seconds, log file.
STEP_NAMES=()
STEP_RESULTS=()
STEP_SECONDS=()
STEP_LOGS=()
ANY_FAILED=0

record() {  # name result seconds log
  STEP_NAMES+=("$1")
  STEP_RESULTS+=("$2")
  STEP_SECONDS+=("$3")
  STEP_LOGS+=("$4")
  case "$2" in FAILED*) ANY_FAILED=1 ;; esac
  write_report
}

# run_step NAME LOG COMMAND...: runs the command with its output in $OUT/LOG, times it, records it.
run_step() {
  local name=$1 log=$2
  shift 2
  echo "== $name: $* (log: $OUT/$log)"
  local start=$SECONDS
  "$@" >"$OUT/$log" 2>&1
  local status=$?
  local elapsed=$((SECONDS - start))
  if [ "$status" -eq 0 ]; then
    record "$name" "ok" "$elapsed" "$log"
  else
    record "$name" "FAILED (exit $status)" "$elapsed" "$log"
  fi
  echo "   -> ${STEP_RESULTS[-1]} in ${elapsed}s"
  return "$status"
}

skip_step() {  # name why
  echo "== $1: skipped ($2)"
  record "$1" "skipped: $2" "" ""
}

# ---- what the report shows -------------------------------------------------------------------------

# The last summary line of a pytest log ("=== 3 passed, 1 skipped in 12.3s ===", or without the ='s
# under -q), without the ='s.
pytest_summary() {
  grep -E '(passed|failed|skipped|error|errors|deselected|xfailed|xpassed|no tests ran).* in [0-9.]+s' "$1" 2>/dev/null |
    tail -1 | sed -E 's/^=+ //; s/ =+$//'
}

# pytest's short summary: FAILED/ERROR lines (-rfE), at most 60.
pytest_failures() {
  grep -E '^(FAILED|ERROR) ' "$1" 2>/dev/null | head -60
}

pytest_section() {  # title log
  local title=$1 log=$2
  echo "## $title"
  echo
  if [ ! -s "$OUT/$log" ]; then
    echo "Not run (see Steps)."
    echo
    return
  fi
  local summary
  summary=$(pytest_summary "$OUT/$log")
  echo "Summary: \`${summary:-no summary line: see $log}\`"
  echo
  if grep -q "KeyboardInterrupt" "$OUT/$log"; then
    echo "**Interrupted** after TEST_TIMEOUT=${TEST_TIMEOUT:-1500}s: the summary covers the tests run until then."
    echo
  fi
  local failures
  failures=$(pytest_failures "$OUT/$log")
  if [ -n "$failures" ]; then
    echo "Failures (details in \`$log\`):"
    echo
    echo '```'
    echo "$failures"
    echo '```'
  elif [[ "$(result_of_log "$log")" == FAILED* ]]; then
    echo "The run failed without a test failing; the end of \`$log\`:"
    echo
    echo '```'
    tail -15 "$OUT/$log"
    echo '```'
  else
    echo "No failures."
  fi
  echo
}

result_of_log() {  # log: the result of the step that wrote it
  local i
  for i in "${!STEP_LOGS[@]}"; do
    if [ "${STEP_LOGS[$i]}" = "$1" ]; then
      echo "${STEP_RESULTS[$i]}"
    fi
  done
}

benchmark_section() {
  echo "## Benchmark (benchmarks/gpu.py)"
  echo
  if [ ! -f benchmarks/gpu.py ]; then
    echo "benchmarks/gpu.py is not in this checkout: not run."
    echo
    return
  fi
  if [ ! -s "$OUT/bench.log" ]; then
    echo "Not run (see Steps)."
    echo
    return
  fi
  # The benchmark's own markdown tables when it wrote any, else the end of its output.
  local tables
  tables=$(find "$OUT/bench" -maxdepth 2 -name '*.md' 2>/dev/null | sort)
  if [ -n "$tables" ]; then
    local table
    for table in $tables; do
      echo "From \`${table#"$OUT"/}\`:"
      echo
      cat "$table"
      echo
    done
  else
    echo "The end of \`bench.log\`:"
    echo
    echo '```'
    tail -40 "$OUT/bench.log"
    echo '```'
    echo
  fi
}

commit_line() {  # a copy of the tree may come without its .git
  local commit
  if commit=$(git rev-parse --short HEAD 2>/dev/null); then
    git diff --quiet HEAD 2>/dev/null && echo "$commit" || echo "$commit (with uncommitted changes)"
  else
    echo "unknown (not a git checkout)"
  fi
}

write_report() {
  {
    echo "# GPU check of torch-chainermn"
    echo
    echo "Started $STARTED; this report written $(date -u '+%Y-%m-%d %H:%M:%S UTC')."
    echo
    echo "| | |"
    echo "|---|---|"
    echo "| commit | $(commit_line) |"
    echo "| host | $(hostname), $(nproc) cores, $(uname -r) |"
    echo "| GPU | ${GPU_LINE:-not looked at yet} |"
    # The "name: value" lines the versions and extension steps print (not their errors, if any).
    cat "$OUT/versions.log" "$OUT/extension.log" 2>/dev/null |
      grep -E "^(python|torch|torch's NCCL|nvcc|extension|libnccl linked): " |
      sed 's/^\([^:]*\): \(.*\)$/| \1 | \2 |/' 
    echo
    if [ "${GPU_PRESENT:-0}" != 1 ]; then
      echo "**No GPU on this machine** (${GPU_LINE:-nvidia-smi not run}): the \`cuda\` tests were skipped"
      echo "and the benchmark was not run."
      echo
    fi
    echo "## Steps"
    echo
    echo "| step | result | seconds | log |"
    echo "|---|---|---|---|"
    local i
    for i in "${!STEP_NAMES[@]}"; do
      echo "| ${STEP_NAMES[$i]} | ${STEP_RESULTS[$i]} | ${STEP_SECONDS[$i]} | ${STEP_LOGS[$i]:+\`${STEP_LOGS[$i]}\`} |"
    done
    echo
    pytest_section "CUDA tests (pytest -m cuda)" pytest-cuda.log
    pytest_section "CPU tests (test_threads, test_torch_hooks, test_mean)" pytest-cpu.log
    benchmark_section
  } >"$REPORT"
}

# ---- the steps -------------------------------------------------------------------------------------

# 1. The machine. No GPU is not a failure: the script then checks what it can (the CUDA tests skip).
GPU_PRESENT=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >"$OUT/machine.log" 2>&1; then
  nvidia-smi >>"$OUT/machine.log" 2>&1
  GPU_LINE="$(nvidia-smi -L | wc -l) x $(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap \
    --format=csv,noheader | head -1) (name, driver, memory, compute capability)"
  GPU_PRESENT=1
else
  GPU_LINE="none: nvidia-smi is missing or finds no GPU"
  echo "$GPU_LINE" >"$OUT/machine.log"
fi
record "machine" "ok" 0 machine.log

# 2. Versions: what the report's table shows (one "name: value" per line).
versions() {
  echo "python: $("$PYTHON" -c 'import sys; print(sys.version.split()[0])')"
  "$PYTHON" - <<'PY'
import torch
print(f"torch: {torch.__version__} (CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()})")
try:
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else "none (CPU torch)"
except Exception as error:  # noqa: BLE001  a CUDA torch without NCCL says why
    nccl = f"unknown ({error})"
print(f"torch's NCCL: {nccl}")
PY
  local status=$?
  if command -v nvcc >/dev/null 2>&1; then
    echo "nvcc: $(nvcc --version | sed -n 's/.*release \([^,]*\),.*/\1/p')"
  else
    echo "nvcc: not on PATH"
  fi
  return $status
}
run_step "versions" versions.log versions
cat "$OUT/versions.log"

# 3. Build.
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  skip_step "build" "SKIP_BUILD=1"
else
  run_step "build" build.log "$PYTHON" setup.py build_ext --inplace -j "${JOBS:-16}"
fi

# 4. What was built. With a GPU and a CUDA torch, an extension without its CUDA path is a failure.
extension() {
  GPU_PRESENT=$GPU_PRESENT "$PYTHON" - <<'PY' || return 1
import os
import torch
import torch_chainermn._C as c
nccl = c.nccl_version() or "none"
print(f"extension: cuda_built {c.cuda_built}, mpi_built {c.mpi_built}, NCCL {nccl}, CUDA transports {c.cuda_transports}")
if os.environ["GPU_PRESENT"] == "1" and torch.version.cuda and not c.cuda_built:
    raise SystemExit("a GPU and a CUDA torch, but the extension was built without CUDA")
PY
  local module
  module=$(ls torch_chainermn/_C*.so 2>/dev/null | head -1)
  if [ -z "$module" ]; then
    echo "no torch_chainermn/_C*.so"
    return 1
  fi
  local linked
  linked=$(ldd "$module" | grep -i nccl | sed 's/^[[:space:]]*//')
  echo "libnccl linked: ${linked:-none}"
}
run_step "extension" extension.log extension
cat "$OUT/extension.log"

# 5. The CUDA tests. -rfE: the short summary lists every failure and error (the report quotes it).
# SIGINT at the time limit: pytest stops and still prints its summary. With a GPU, a run in which no
# test passed (torch sees no GPU: everything skipped) is a failure too.
cuda_tests() {
  local extra=()
  eval "extra=(${PYTEST_ARGS:-})"  # shell words, so that -k "a and b" stays one argument
  timeout -s INT -k 60 "${TEST_TIMEOUT:-1500}" "$PYTHON" -m pytest -m cuda -v -rfE -p no:cacheprovider "${extra[@]}"
  local status=$?
  if [ "$status" -eq 0 ] && [ "$GPU_PRESENT" = 1 ] && ! pytest_summary "$OUT/pytest-cuda.log" | grep -q passed; then
    echo "gpu_check: a GPU is present but no cuda test passed (do torch and the driver see it?)"
    return 1
  fi
  return "$status"
}
run_step "CUDA tests" pytest-cuda.log cuda_tests

# 6. Quick CPU tests: the thread, hook and mean paths the CUDA code shares.
if [ "${SKIP_CPU_TESTS:-0}" = 1 ]; then
  skip_step "CPU tests" "SKIP_CPU_TESTS=1"
else
  run_step "CPU tests" pytest-cpu.log timeout -s INT -k 60 "${TEST_TIMEOUT:-1500}" \
    "$PYTHON" -m pytest -q -rfE -p no:cacheprovider tests/test_threads.py tests/test_torch_hooks.py tests/test_mean.py
fi

# 7. The GPU benchmark.
if [ ! -f benchmarks/gpu.py ]; then
  skip_step "benchmark" "benchmarks/gpu.py is not in this checkout"
elif [ "${SKIP_BENCH:-0}" = 1 ]; then
  skip_step "benchmark" "SKIP_BENCH=1"
elif [ "$GPU_PRESENT" != 1 ]; then
  skip_step "benchmark" "no GPU"
else
  mkdir -p "$OUT/bench"
  run_step "benchmark" bench.log timeout -k 30 "${BENCH_TIMEOUT:-900}" "$PYTHON" benchmarks/gpu.py --out "$OUT/bench"
fi

echo "Report: $REPORT"
if [ "$ANY_FAILED" = 1 ]; then
  echo "Some steps FAILED: see the report."
  exit 1
fi
exit 0
