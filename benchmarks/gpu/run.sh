#!/usr/bin/env bash
# GPU benchmark (issue 13, item 4): ours against none, per_block, sqrt_n, selective_matmul and
# torch.compile's activation_memory_budget, on a GPT-2-medium-sized and a ~1B Llama-shaped model
# (random weights, bf16), at 0.75/0.5/0.3 x the no-checkpoint activations; estimate-mode (H200)
# predictions beside the measured numbers. One H200: under 8 minutes, setup included.
#
#   bash benchmarks/gpu/run.sh [--out DIR] [bench.py options]    on a machine with a CUDA GPU
#   bash benchmarks/gpu/run.sh --dry-run [--out DIR]              CPU, tiny sizes, fp32 (CI)
#
# Prints one Markdown table last; writes DIR/results.json (every row, the machine, the dates),
# DIR/table.md, DIR/bench.log and the profiles (DIR/<model>[.estimate].profile.json.gz);
# DIR defaults to benchmarks/gpu/out. `python benchmarks/gpu/bench.py --help` lists the options.
#
# Python: $PYTHON, else the active virtualenv's, else .venv/bin/python, else python3 - the first
# whose torch sees a GPU (any torch for --dry-run). torch is never installed or upgraded. Missing
# transformers, pulp, highspy, numpy are installed with pip: from benchmarks/gpu/wheels when it
# holds wheels (fetch_wheels.sh; for a machine that reaches no registry), else from the index.
# The project is put on the path (pip install -e . --no-deps, and PYTHONPATH as a fallback).
set -euo pipefail
T0=$SECONDS
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TRANSFORMERS_VERBOSITY=error
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

DRY=0
OUT_DIR=benchmarks/gpu/out
HAS_LIMIT=0
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
        --dry-run) DRY=1 ;;
        --out) OUT_DIR=${args[i + 1]:-$OUT_DIR} ;;
        --out=*) OUT_DIR=${args[i]#--out=} ;;
        --time-limit-s | --time-limit-s=*) HAS_LIMIT=1 ;;
        -h | --help) DRY=1 ;;
    esac
done
say() { echo "[run.sh $((SECONDS - T0))s] $*" >&2; }

# -- python -------------------------------------------------------------------------------------
candidates=()
[[ -n ${PYTHON:-} ]] && candidates+=("$PYTHON")
[[ -n ${VIRTUAL_ENV:-} ]] && candidates+=("$VIRTUAL_ENV/bin/python")
[[ -x .venv/bin/python ]] && candidates+=("$ROOT/.venv/bin/python")
candidates+=(python3 python)
if [[ $DRY == 1 ]]; then
    check='import torch'
else
    check='import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
fi
PY=""
for c in "${candidates[@]}"; do
    command -v "$c" >/dev/null 2>&1 || continue
    if "$c" -c "$check" >/dev/null 2>&1; then PY=$c; break; fi
done
if [[ -z $PY ]]; then
    if [[ $DRY == 1 ]]; then
        echo "run.sh: no python with torch among: ${candidates[*]}" >&2
    else
        echo "run.sh: no python whose torch sees a CUDA GPU among: ${candidates[*]}" \
            "(torch.cuda.is_available() is False); on a CPU, use --dry-run" >&2
    fi
    exit 2
fi
PY=$("$PY" -c 'import sys; print(sys.executable)')   # absolute: used from other folders too
say "python: $PY ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'))"
if [[ $DRY == 0 ]] && command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv >&2 || true
fi

# -- what the benchmark needs, never torch -----------------------------------------------------
missing=$("$PY" - <<'EOF'
import importlib.util
mods = {"transformers": "transformers", "pulp": "pulp", "highspy": "highspy", "numpy": "numpy"}
print(" ".join(pkg for mod, pkg in mods.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [[ -n $missing ]]; then
    constraints=$(mktemp)
    "$PY" -c 'import torch; print("torch==" + torch.__version__)' >"$constraints"
    WHEELS=${WHEELS:-$ROOT/benchmarks/gpu/wheels}
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        from=(--no-index --find-links "$WHEELS")
        say "installing $missing from $WHEELS"
    else
        from=(--timeout 20 --retries 1)
        say "installing $missing from the package index"
    fi
    for pkg in $missing; do   # one at a time: a package that cannot be had stops no other
        "$PY" -m pip install -q "${from[@]}" -c "$constraints" "$pkg" \
            || say "pip could not install $pkg (a machine without a registry: run" \
                "fetch_wheels.sh where pip works and carry benchmarks/gpu/wheels)"
    done
    rm -f "$constraints"
    if ! "$PY" -c 'import transformers' >/dev/null 2>&1; then
        echo "run.sh: transformers is missing and could not be installed" >&2
        exit 2
    fi
    if ! "$PY" -c 'import pulp' >/dev/null 2>&1; then
        say "PuLP missing: 'auto' plans without the ILP (dp and nested only)"
    elif ! "$PY" -c 'import highspy' >/dev/null 2>&1; then
        say "highspy missing: the ILP runs on CBC (PuLP's own), not HiGHS"
    fi
fi
if ! (cd /tmp && PYTHONPATH= "$PY" -c 'import planner, solvers') >/dev/null 2>&1; then
    say "pip install -e . (no dependencies, no build isolation)"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
        || say "pip install -e . failed; the project is used from PYTHONPATH=$ROOT"
fi

# -- the benchmark --------------------------------------------------------------------------------
mkdir -p "$OUT_DIR"
extra=()
if [[ $DRY == 1 ]]; then
    budget=170   # the whole dry run, CI's guard
else
    budget=$((470 - (SECONDS - T0)))   # 8 minutes less a margin, setup counted
    # the driver stops and writes its results ~30 s before the hard limit (imports, writing)
    [[ $HAS_LIMIT == 1 ]] || extra+=(--time-limit-s "$((budget - 35))")
fi
say "running the benchmark (hard limit ${budget} s), output in $OUT_DIR"
set +e
timeout -k 10 "$budget" "$PY" "$ROOT/benchmarks/gpu/bench.py" "$@" "${extra[@]}" \
    2> >(tee "$OUT_DIR/bench.log" >&2)
rc=$?
set -e
if [[ $rc == 124 || $rc == 137 ]]; then
    echo "run.sh: the benchmark ran past ${budget} s and was stopped; partial results in" \
        "$OUT_DIR/results.json" >&2
fi
say "exit $rc after $((SECONDS - T0)) s"
exit "$rc"
