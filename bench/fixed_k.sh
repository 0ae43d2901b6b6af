#!/usr/bin/env bash
# docs/benchmarks.md "Speculative decoding": transformers fixed k=3/5 (really fixed: confidence stop off), hf_specdec
# fixed k=5 and adaptive; 5 problems, 96 tokens, 4-bit draft. bash bench/fixed_k.sh [OUT] [more eval flags]
cd "$(dirname "$0")/.." && exec python -m eval run --out "${1:-results/fixed_k}" \
    --target bundle:qwen2.5-coder-1.5b-instruct --draft bundle:qwen2.5-coder-0.5b-instruct \
    --dtype bf16 --draft-quant 4bit --spec-k 5 \
    --task humaneval --limit 5 --max-new-tokens 96 \
    --modes plain,hf_assisted,hf_assisted_k3,hf_assisted_k5,specdec_fixed,specdec_adaptive "${@:2}"
