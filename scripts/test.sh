#!/usr/bin/env bash
# Sets up .venv (if needed) and runs the CPU test suite on 2 workers. Extra arguments go to pytest.
#   bash scripts/test.sh            the whole suite (what CI runs; <= 20 minutes on a 2-core machine)
#   bash scripts/test.sh --quick    the edit-test tier: the tests marked `quick`, at least one per test file
#                                   (<= 5 minutes; CONTRIBUTING.md)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
select=()
if [ "${1:-}" = "--quick" ]; then
  shift
  select=(-m quick)
fi
exec .venv/bin/python -m pytest -n 2 --maxschedchunk 1 "${select[@]}" "$@"
