#!/usr/bin/env bash
# Sets up .venv (if needed) and runs the whole CPU test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -n 2 --maxschedchunk 1 "$@"
