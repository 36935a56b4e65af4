#!/usr/bin/env bash
# Re-measure the side-by-side comparison of every benchmark model, then rewrite RESULTS.md.
#   bash benchmarks/run_compare.sh [model ...]     (default: all six; each takes tens of minutes on 2 cores: benchmarks/RESULTS.md)
# Needs the venv active and tcmalloc (Debian: apt install libtcmalloc-minimal4); see RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
TCMALLOC=${TCMALLOC:-/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4}
if [[ ! -e "$TCMALLOC" ]]; then
    echo "run_compare.sh: $TCMALLOC not found; install libtcmalloc-minimal4 or set TCMALLOC=" >&2
    exit 2
fi
models=("$@")
[[ ${#models[@]} -gt 0 ]] || models=(gpt_eager hf_gpt2 hf_llama resnet_bn unet deep_narrow_cnn)
for m in "${models[@]}"; do
    LD_PRELOAD="$TCMALLOC" ckpt-planner compare "benchmarks.cpu_sizes:$m" \
        --compile-backend aot_eager,inductor --graph --repeats 5 -o "benchmarks/compare/$m" \
        2> >(grep --line-buffered -v '^USDT:' >&2)
done
python benchmarks/results_md.py
