#!/usr/bin/env bash
# Fetch the wheels run.sh installs on a GPU machine that reaches no package registry: PuLP and
# highspy (the ILP solver of `auto`; without them `auto` plans with dp and nested only), for the
# GPU image's Python (3.12, x86-64 Linux). Run here, where pip reaches PyPI; then carry
# benchmarks/gpu/wheels (git-ignored) with the call that runs run.sh, which installs from it.
#   bash benchmarks/gpu/fetch_wheels.sh [python-version, default 3.12]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PYV=${1:-3.12}
PY=${PYTHON:-python3}
[[ -x ../../.venv/bin/python && -z ${PYTHON:-} ]] && PY=../../.venv/bin/python
mkdir -p wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d wheels "pulp==3.3.2" "highspy==1.16.0"
ls -l wheels
