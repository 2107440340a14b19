#!/usr/bin/env bash
# The whole suite, one pytest process per group of test directories; arguments go to every
# pytest (e.g. -m "not slow"). `python -m pytest -q` runs the same tests in one process, but a
# process that lives through the whole suite holds every program XLA compiled for it; groups keep
# each process to a few minutes of compiled code. Every group runs; the exit status is the first
# failing group's.
set -uo pipefail
cd "$(dirname "$0")/.."

own=(tests/nn tests/posenc tests/train tests/infra tests/e2e)
ignore=()
for dir in "${own[@]}"; do ignore+=("--ignore=$dir"); done
groups=("${own[@]}" "tests ${ignore[*]}")

status=0
for group in "${groups[@]}"; do
  echo "=== python -m pytest -q ${group%% --ignore*}$([[ $group == *--ignore* ]] && echo ' (the rest)')"
  # shellcheck disable=SC2086  # a group is several words
  python -m pytest -q $group "$@"
  code=$?
  if [[ $code -eq 5 ]]; then code=0; fi  # no test of this group matched the arguments' filter
  if [[ $code -ne 0 && $status -eq 0 ]]; then status=$code; fi
done
exit $status
