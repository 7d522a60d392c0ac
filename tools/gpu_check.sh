#!/usr/bin/env bash
# The GPU check in steps that each fit in one command of the device machine (docs/cuda-status.md).
#
#   tools/gpu_check.sh list           the steps in order, their time limits, their results so far
#   tools/gpu_check.sh all            every step not passed yet, in order, while they fit in BUDGET_S
#   tools/gpu_check.sh STEP [STEP..]  the named steps, even if they passed before
#   tools/gpu_check.sh together       the whole check in one call (~7 min, what a 15-minute device
#                                     budget allows): the build, then the GPU pytest steps side by
#                                     side (each its own ranks; one GPU has room), then the benchmark
#                                     with what is left of BUDGET_S (test_device_watch: CPU, in CI)
#
# On the GPU machine (one H100, 16 cores, Python 3.12, torch 2.11+cu130, nvcc, no internet), through
# the device tool's `run` with timeout_s 600 and carry [".gpu-check"], each call:
#   1. run `tools/gpu_check.sh all`: the build, then the steps that fit in 540 s;
#   2. here, keep the state that came back (FILES_AT: the reply's files_at):
#        mkdir -p .gpu-check && for a in FILES_AT/*.tar.gz; do tar -xzf "$a" -C .gpu-check; done
#   3. again at once (a machine stays warm 30 s and keeps its build) until FILES_AT/summary.md has a
#      result for every step. A fresh machine rebuilds and skips what the carried state says passed.
#
# A step runs under `timeout -s INT` (pytest still prints its summary), keeps its logs and state in
# $STATE/STEP/ and packs them into ONE archive, $OUT/STEP.tar.gz; then $OUT/summary.md is rewritten
# (machine, versions, a table of the steps, FAILED/ERROR lines). Only 8 files come back from $OUT, so
# a call writes at most 7 archives. The build counts as passed only while torch_chainermn/_C*.so is
# there and current. Without a GPU the CUDA tests skip: "skipped: no GPU", not passed (a GPU run redoes
# them); with one, a pytest step in which no test passed fails (torch does not see the GPU).
# Exit status: 0 when every step run in this call passed, 1 otherwise, 2 for bad usage.
#
# Environment: PYTHON (default python3), OUT (default reports/), STATE (default .gpu-check/),
# BUDGET_S (seconds for one call, default 540: a step starts only if its limit fits), JOBS (build,
# default 16), FORCE=1 (`all` reruns passed steps), SKIP_FAILED=1 (`all` passes over steps that failed
# or timed out, the build excepted: every step runs once before any is retried), PYTEST_ARGS and
# BENCH_ARGS (more arguments as shell words: -x, -k "hooks or parallel"; --sections pack,ddp), LIMIT_S
# (caps every step's time limit).
set -uo pipefail  # no -e: a failing step is recorded, and the summary still written

# One line per step: name, time limit in seconds (at most 540), how it runs. 1500 s (25 min) in all.
STEPS=(
  "build                     150  build"
  "test_cuda                 300  pytest -m cuda tests/test_cuda.py"
  "test_cuda_collectives     300  pytest -m cuda tests/test_cuda_collectives.py"
  "test_cuda_torch_hooks     180  pytest -m cuda tests/test_cuda_torch_hooks.py"
  "test_cuda_torch_parallel  240  pytest -m cuda tests/test_cuda_torch_parallel.py"
  "test_functions_cuda        60  pytest -m cuda tests/test_functions.py"
  "test_device_watch          30  pytest tests/test_device_watch.py"
  "bench                     240  bench"
)
MAX_ARCHIVES=7

absolute() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
repo=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
OUT=$(absolute "${OUT:-$repo/reports}")
STATE=$(absolute "${STATE:-$repo/.gpu-check}")
BUDGET_S=${BUDGET_S:-540}
cd "$repo" || exit 2
export PYTHONUNBUFFERED=1
ARCHIVES=0  # archives written in this call
# The first GPU as "name, driver, memory"; empty when nvidia-smi is missing or finds none.
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1) || GPU=""

# ---- the step table and the state ------------------------------------------------------------------

step_names() { local line; for line in "${STEPS[@]}"; do echo "${line%% *}"; done; }
step_spec() {  # name: prints "limit how args..."; fails for an unknown name
  local line name rest
  for line in "${STEPS[@]}"; do
    read -r name rest <<<"$line"
    if [ "$name" = "$1" ]; then echo "$rest"; return 0; fi
  done
  return 1
}
state_get() { sed -n "s/^$2=//p" "$STATE/$1/state" 2>/dev/null | head -1; }  # step key
commit_id() { git describe --always --dirty 2>/dev/null || echo "no git"; }
sources_hash() {  # what the build compiles: a copy of the tree may not keep the files' times
  find csrc setup.py tools/build_sources.py -type f -print0 2>/dev/null | sort -z | xargs -0 sha1sum | sha1sum | cut -c1-12
}
module() { find torch_chainermn -maxdepth 1 -name '_C*.so' | head -1; }
build_current() {  # the extension is there, newer than csrc/ or built from these very sources
  local so
  so=$(module)
  [ -n "$so" ] || return 1
  [ -z "$(find csrc -type f -newer "$so" -print -quit)" ] || [ "$(state_get build sources)" = "$(sources_hash)" ]
}
step_passed() { [ "$(state_get "$1" result)" = passed ] && { [ "$1" != build ] || build_current; }; }
step_limit() {  # name: its limit in seconds, capped by LIMIT_S (a call that must end sooner, or steps side by side)
  local limit
  limit=$(step_spec "$1" | awk '{print $1}')
  if [ -n "${LIMIT_S:-}" ] && [ "$LIMIT_S" -lt "$limit" ]; then limit=$LIMIT_S; fi
  echo "$limit"
}
step_status() {  # the result shown for a step
  local result
  result=$(state_get "$1" result)
  if [ -z "$result" ]; then echo "not run"
  elif [ "$1" = build ] && [ "$result" = passed ] && ! build_current; then echo "passed, now stale (no .so, or csrc/ changed)"
  else echo "$result"
  fi
}

# ---- the three kinds of step: each sets RESULT (and PYTEST, the pytest summary line) ----------------

classify() {  # exit status, limit: RESULT for a status that is not a success (124, 137: timeout's)
  case $1 in 124|137) RESULT="timed out (${2} s)" ;; *) RESULT="failed (exit $1)" ;; esac
}

print_versions() {  # "name: value" lines; fails when the extension does not import, or lacks CUDA on a GPU
  local nvcc nccl
  nvcc=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([^,]*\),.*/\1/p')
  nccl=$(ldd "$(module)" 2>/dev/null | grep -i nccl | sed 's/^[[:space:]]*//')
  echo "nvcc: ${nvcc:-not on PATH}"
  echo "libnccl linked: ${nccl:-none}"
  GPU="$GPU" "$PYTHON" - <<'PY'
import os, sys
import torch
print(f"python: {sys.version.split()[0]}")
try:
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else "none"
except Exception as error:  # noqa: BLE001  say why
    nccl = f"unknown ({error})"
print(f"torch: {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, sees a GPU: {torch.cuda.is_available()}")
import torch_chainermn._C as c
print(f"built: cuda_built {c.cuda_built}, nccl_version {c.nccl_version() or 'none'}, cuda_transports {list(c.cuda_transports)}")
if os.environ["GPU"] and not c.cuda_built:
    sys.exit("gpu_check: a GPU is present but the extension was built without CUDA")
PY
}

run_build() {  # dir limit
  # CHAINERMN_TESTING=1: the test build (the CUDA tests use _C.testing).
  CHAINERMN_TESTING=1 timeout -s INT -k 20 "$2" "$PYTHON" setup.py build_ext --inplace -j "${JOBS:-16}" \
    >"$1/build.log" 2>&1
  local status=$?
  print_versions >"$1/versions.txt" 2>&1
  local versions=$?
  sed 's/^/   /' "$1/versions.txt"
  if [ "$status" -ne 0 ]; then classify "$status" "$2"
  elif [ "$versions" -ne 0 ]; then RESULT="failed: see versions.txt"
  else RESULT=passed
  fi
}

run_pytest() {  # dir limit name pytest-arguments...
  local dir=$1 limit=$2 name=$3 extra=()
  shift 3
  eval "extra=(${PYTEST_ARGS:-})"  # shell words, so that -k "a and b" stays one argument
  timeout -s INT -k 20 "$limit" "$PYTHON" -m pytest -v -rfE -p no:cacheprovider "$@" "${extra[@]}" \
    >"$dir/$name.log" 2>&1
  local status=$?
  PYTEST=$(grep -E '(passed|failed|skipped|error|errors|deselected|no tests ran).* in [0-9.]+s' "$dir/$name.log" |
    tail -1 | sed -E 's/^=+ //; s/ =+$//')
  if [ "$status" -ne 0 ]; then classify "$status" "$limit"
  elif [[ $PYTEST =~ [0-9]+\ passed ]]; then RESULT=passed
  elif [ -n "$GPU" ]; then RESULT="failed (a GPU, but no test passed: does torch see it?)"
  else RESULT="skipped: no GPU"
  fi
}

run_bench() {  # dir limit
  if [ -z "$GPU" ]; then
    echo "no GPU (nvidia-smi finds none): benchmarks/gpu.py measures CUDA, not run" | tee "$1/bench.log"
    RESULT="skipped: no GPU"
    return
  fi
  local extra=()
  eval "extra=(${BENCH_ARGS:-})"
  mkdir -p "$1/results"
  timeout -s INT -k 20 "$2" "$PYTHON" benchmarks/gpu.py --out "$1/results" "${extra[@]}" >"$1/bench.log" 2>&1
  local status=$?
  if [ "$status" -eq 0 ]; then RESULT=passed; else classify "$status" "$2"; fi
}

# ---- one step, the summary -------------------------------------------------------------------------

run_step() {  # name: runs it, records its state, packs its archive, rewrites the summary
  local name=$1 spec dir=$STATE/$1 start=$SECONDS seconds
  read -r -a spec <<<"$(step_spec "$name")"
  spec[0]=$(step_limit "$name")
  rm -rf "$dir" && mkdir -p "$dir" || return 1
  echo "== $name (limit ${spec[0]} s): ${spec[*]:1}"
  RESULT="failed" PYTEST=""
  case ${spec[1]} in
    build) run_build "$dir" "${spec[0]}" ;;
    pytest) run_pytest "$dir" "${spec[0]}" "$name" "${spec[@]:2}" ;;
    bench) run_bench "$dir" "${spec[0]}" ;;
  esac
  seconds=$((SECONDS - start))
  printf 'result=%s\nseconds=%s\ndate=%s\ncommit=%s\nsources=%s\npytest=%s\n' "$RESULT" "$seconds" \
    "$(date -u '+%Y-%m-%d %H:%M UTC')" "$(commit_id)" "$(sources_hash)" "$PYTEST" >"$dir/state"
  tar -czf "$OUT/$name.tar.gz" -C "$STATE" "$name" && ARCHIVES=$((ARCHIVES + 1))
  write_summary
  echo "   -> $RESULT in ${seconds} s${PYTEST:+: $PYTEST}"
  [ "$RESULT" = passed ]
}

failure_lines() {  # FAILED/ERROR lines of the failed steps (else the end of their log), at most 40
  local name log
  for name in $(step_names); do
    case $(state_get "$name" result) in failed*|"timed out"*) ;; *) continue ;; esac
    log=$STATE/$name/$name.log
    [ "$name" = build ] && log=$STATE/build/build.log
    [[ $(state_get "$name" result) == *versions.txt ]] && log=$STATE/build/versions.txt
    if grep -qE '^(FAILED|ERROR) ' "$log" 2>/dev/null; then
      grep -E '^(FAILED|ERROR) ' "$log"
    else
      echo "$name, the end of $(basename "$log"):"
      tail -5 "$log" 2>/dev/null
    fi
  done | head -40
}

when() { [ -f "$STATE/$1/state" ] && echo "$(state_get "$1" date), $(state_get "$1" commit)"; }

write_summary() {
  local name failures
  {
    echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(commit_id)"
    echo
    echo "- machine: ${GPU:-no GPU (nvidia-smi finds none)}; $(nproc) cores"
    grep -E '^(python|torch|nvcc|built|libnccl linked): ' "$STATE/build/versions.txt" 2>/dev/null | sed 's/^/- /'
    echo
    echo "| step | result | seconds | pytest | when |"
    echo "|---|---|---|---|---|"
    for name in $(step_names); do
      echo "| $name | $(step_status "$name") | $(state_get "$name" seconds) | $(state_get "$name" pytest) | $(when "$name") |"
    done
    failures=$(failure_lines)
    # shellcheck disable=SC2016  # markdown's backquotes
    [ -z "$failures" ] || printf '\nFailures (logs in the archives):\n\n```\n%s\n```\n' "$failures"
  } >"$OUT/summary.md"
}

list_steps() {
  local line name limit total=0
  printf '%-26s %6s  %s\n' step limit "result so far (state: $STATE)"
  for line in "${STEPS[@]}"; do
    read -r name limit _ <<<"$line"
    printf '%-26s %5ss  %s\n' "$name" "$limit" "$(step_status "$name")"
    total=$((total + limit))
  done
  echo "limits in all: ${total} s ($((total / 60)) min); one call runs steps while they fit in BUDGET_S=${BUDGET_S} s"
}

skip_in_all() {  # name: whether `all` passes over it
  [ "${FORCE:-0}" = 1 ] && return 1
  step_passed "$1" && { echo "== $1: passed before ($(state_get "$1" date)), skipped"; return 0; }
  [ "${SKIP_FAILED:-0}" = 1 ] && [ "$1" != build ] || return 1
  case $(state_get "$1" result) in
    failed*|"timed out"*) echo "== $1: $(state_get "$1" result) before, skipped (SKIP_FAILED=1)" ;;
    *) return 1 ;;
  esac
}

together() {  # see the header; returns like main
  local name failed=0 left pids=()
  mkdir -p "$OUT" "$STATE" || return 2
  run_step build >/dev/null || { tail -40 "$STATE/build/build.log"; write_summary; return 1; }
  for name in $(step_names); do
    case $(step_spec "$name") in *"pytest -m cuda"*) ;; *) continue ;; esac
    LIMIT_S=${LIMIT_S:-290} "$0" "$name" >"$STATE/$name.out" 2>&1 &
    pids+=($!)
  done
  for name in "${pids[@]}"; do wait "$name" || failed=1; done
  left=$((BUDGET_S - SECONDS - 15))
  if [ "$left" -ge 60 ]; then
    LIMIT_S=$left run_step bench >/dev/null || failed=1
  else
    echo "== bench: not run, ${left} s left of BUDGET_S=$BUDGET_S"
  fi
  write_summary
  cat "$OUT/summary.md"
  return "$failed"
}

main() {
  local mode=all name limit failed=0 todo=()
  case ${1:-} in
    list) list_steps; return 0 ;;
    together) together; return $? ;;
    all) mapfile -t todo < <(step_names) ;;
    ""|-h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; return 2 ;;
    *) mode=named todo=("$@")
       for name in "$@"; do step_spec "$name" >/dev/null || { echo "unknown step: $name (see: $0 list)"; return 2; }; done ;;
  esac
  mkdir -p "$OUT" "$STATE" || return 2
  for name in "${todo[@]}"; do
    if [ "$mode" = all ] && skip_in_all "$name"; then continue; fi
    limit=$(step_limit "$name")
    if [ $((SECONDS + limit)) -gt "$BUDGET_S" ] || [ "$ARCHIVES" -ge "$MAX_ARCHIVES" ]; then
      echo "== stopped before $name (limit $limit s; $((BUDGET_S - SECONDS)) s left of BUDGET_S=$BUDGET_S," \
        "$ARCHIVES archives written): run the same command again"
      break
    fi
    if ! run_step "$name"; then
      failed=1
      if [ "$mode" = all ] && [ "$name" = build ]; then echo "== the build failed: nothing else can run"; break; fi
    fi
  done
  write_summary
  echo "== summary: $OUT/summary.md"
  cat "$OUT/summary.md"
  return "$failed"
}

main "$@"
