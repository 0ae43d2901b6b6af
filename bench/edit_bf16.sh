#!/usr/bin/env bash
# docs/benchmarks.md "Eval harness": edit task, bf16 draft, 12 problems.
# bash bench/edit_bf16.sh [OUT] [more eval flags]   (OUT relative to the repository root)
cd "$(dirname "$0")/.." && exec python -m eval run --out "${1:-results/edit_bf16}" \
    --target bundle:qwen2.5-coder-1.5b-instruct --draft bundle:qwen2.5-coder-0.5b-instruct \
    --dtype bf16 --draft-quant none \
    --task humaneval_edit --limit 12 --max-new-tokens 128 \
    --modes plain,hf_assisted,specdec_adaptive "${@:2}"
