#!/usr/bin/env bash
# Creates .venv with Python >= 3.12 and installs m3jax (editable) with its test, eval and serve extras (eval:
# lm-evaluation-harness, for tests/test_lm_eval.py, ~0.5 GB of wheels, no torch; serve: FastAPI and uvicorn, for
# m3jax serve and its tests).
# Finds Python 3.12+ on PATH or under pyenv; idempotent (re-running only re-checks the install).
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for cand in python3.12 python3.13 python3; do  # 3.12 first: what the GPU machine runs
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  local root
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for cand in "$root"/versions/3.12.*/bin/python "$root"/versions/3.13.*/bin/python; do
    if [ -x "$cand" ]; then echo "$cand"; return 0; fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python) || { echo "error: m3jax needs Python >= 3.12 (not on PATH, not under pyenv)" >&2; exit 1; }
  echo "[setup] creating .venv with $PY ($("$PY" --version))"
  "$PY" -m venv .venv
fi
stamp=.venv/.m3jax-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing m3jax and its dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING' || true
  .venv/bin/python -m pip install -q -e ".[test,eval,serve]" 2>&1 | grep -v '^WARNING' || true
  .venv/bin/python -c 'import m3jax, jax, flax, openai, lm_eval, fastapi, uvicorn, schemathesis' || { echo "error: install failed" >&2; exit 1; }
  touch "$stamp"
fi
