#!/usr/bin/env bash
# The whole suite, as `make test` and CI run it. Argument: the venv's python.
set -euo pipefail
PY=${1:-.venv/bin/python}
cd "$(dirname "$0")/.."
exec "$PY" -m pytest -q -ra tests "${@:2}"
