#!/usr/bin/env bash
# Every test, slow ones included: bash scripts/test.sh [extra pytest arguments]
# (about 20 minutes on 2 CPU cores; `python -m pytest tests/<dir>` runs one directory).
set -euo pipefail
cd "$(dirname "$0")/.."

export JAX_PLATFORMS=cpu
# The tests' programs are tiny, so their time is XLA compiling, not running: at LLVM's
# optimisation level 0 XLA:CPU compiles them about 40% faster (the floats may differ in the last
# bit where XLA contracts multiply-adds otherwise). A test's subprocesses inherit the flags
# (roformer.testing.subprocess_env); `python -m pytest` runs at XLA's default level.
export XLA_FLAGS="${XLA_FLAGS:---xla_backend_optimization_level=0}"
# Token caches and compiled programs (train.py's persistent compilation cache) go to a directory
# of this run, shared by every test process and removed at the end: the user's ~/.cache/roformer
# is neither read nor written.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
export ROFORMER_CACHE="$logs/cache"

# One pytest process per group of test directories: a single process for the whole suite runs
# out of memory maps. XLA compiles on one thread, so two streams of groups keep both cores busy;
# the second stream's log prints when it ends. Every group runs; the script fails if any failed.
group() {  # group NAME PYTEST_ARGS...: run one group, record its exit status
  local name=$1
  shift
  python -m pytest -q -ra --durations=20 "$@" || echo "$name" >>"$logs/failed"
}
(group e2e tests/e2e "$@") >"$logs/e2e.log" 2>&1 &
e2e=$!
{
  group nn tests/nn "$@"
  group posenc tests/posenc "$@"
  group train tests/train "$@"
  group infra tests/infra "$@"
  group rest tests --ignore=tests/nn --ignore=tests/posenc --ignore=tests/train \
    --ignore=tests/infra --ignore=tests/e2e "$@"
}
wait "$e2e" || echo "e2e (the stream itself)" >>"$logs/failed"
echo "===== tests/e2e ====="
cat "$logs/e2e.log"
if [[ -s "$logs/failed" ]]; then
  echo "failed groups: $(tr '\n' ' ' <"$logs/failed")"
  exit 1
fi
