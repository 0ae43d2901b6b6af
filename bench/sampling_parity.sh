#!/usr/bin/env bash
# docs/eval.md: sampling parity, pass@1 over 4 seeds and KS tests against plain sampling (temperature 0.7, chat).
# bash bench/sampling_parity.sh [OUT] [more eval flags]   (OUT relative to the repository root)
cd "$(dirname "$0")/.." && exec python -m eval run --out "${1:-results/sampling_parity}" \
    --target bundle:qwen2.5-coder-1.5b-instruct --draft bundle:qwen2.5-coder-0.5b-instruct \
    --dtype bf16 --draft-quant none --temperature 0.7 --seeds 0,1,2,3 \
    --task humaneval_chat --limit 20 --max-new-tokens 128 \
    --modes plain,hf_assisted,specdec_adaptive "${@:2}"
