#!/usr/bin/env bash
# Every test, slow ones included: bash scripts/test.sh [extra pytest arguments]
# (13 to 18 minutes on 2 CPU cores; `python -m pytest tests/<dir>` runs one directory).
set -euo pipefail
cd "$(dirname "$0")/.."

export JAX_PLATFORMS=cpu
# The tests' programs are tiny, so their time is XLA compiling, not running. At LLVM's
# optimisation level 0 XLA:CPU compiles them about 40% faster, and with its elemental IR emitters
# in place of the newer MLIR fusion emitters faster again (the suite: 1,428 s at level 0 alone,
# 1,046 s with both; the programs run about 15% slower, and floats may differ in the last bit). A test's
# subprocesses inherit the flags (roformer.testing.subprocess_env); `python -m pytest` runs with
# XLA's defaults.
export XLA_FLAGS="${XLA_FLAGS:---xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false}"
# Token caches and compiled programs (train.py's persistent compilation cache) go to a directory
# of this run, shared by every test process and removed at the end: the user's ~/.cache/roformer
# is neither read nor written.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
export ROFORMER_CACHE="$logs/cache"
# Every process of the run (pytest's and the scripts the tests start) keeps the programs it
# compiles in one JAX compilation cache there: the suite compiles many identical programs (a
# tiny model's train step in several tests, a grid's seeds, a run retrained to check it), and
# each is compiled once.
export JAX_COMPILATION_CACHE_DIR="$ROFORMER_CACHE/xla"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0

# One pytest process per group of tests: a single process for the whole suite runs out of memory
# maps (docs/testing.md). XLA compiles on one thread, so two groups run at a time, the longest
# first, each printing its log when it ends. Every group runs; the script fails if any failed.
GRIDS="tests/e2e/experiments_test.py tests/e2e/experiments_synthetic_test.py tests/e2e/rerun_test.py"
CONFORMANCE=tests/nn/attention/conformance_test.py
groups=(
  "e2e tests/e2e $(printf -- '--ignore=%s ' $GRIDS)"
  "grids $GRIDS"
  "nn tests/nn --ignore=$CONFORMANCE"
  "conformance $CONFORMANCE"
  "rest tests --ignore=tests/nn --ignore=tests/posenc --ignore=tests/train --ignore=tests/infra --ignore=tests/e2e"
  "train tests/train"
  "posenc tests/posenc"
  "infra tests/infra"
)
group() {  # group NAME PYTEST_ARGS...: run one group, print its log when it ends
  local name=$1 start=$SECONDS status=passed
  shift
  python -m pytest -q -ra --durations=20 "$@" >"$logs/$name.log" 2>&1 || {
    # 5: a -k or -m filter of the caller's left nothing of this group to run
    [[ $? == 5 ]] || status=FAILED
  }
  [[ $status == passed ]] || echo "$name" >>"$logs/failed"
  local print=(bash -c 'echo "===== $1: $2 in $3 s ====="; cat "$4"' _ "$name" "$status"
    "$((SECONDS - start))" "$logs/$name.log")
  if command -v flock >/dev/null; then flock "$logs/print" "${print[@]}"; else "${print[@]}"; fi
}
export -f group
export logs
printf '%s\n' "${groups[@]}" | xargs -P 2 -I{} bash -c 'group {} "$@"' _ "$@" || true
if [[ -s "$logs/failed" ]]; then
  echo "failed groups: $(tr '\n' ' ' <"$logs/failed")"
  exit 1
fi
echo "every group passed"
