#!/usr/bin/env bash
# README "Measured" / docs/benchmarks.md "Eval harness": HumanEval, 4-bit draft (20 problems, 128 tokens, greedy).
# bash bench/humaneval_4bit.sh [OUT] [more eval flags]   (OUT relative to the repository root)
cd "$(dirname "$0")/.." && exec python -m eval run --out "${1:-results/humaneval_4bit}" \
    --target bundle:qwen2.5-coder-1.5b-instruct --draft bundle:qwen2.5-coder-0.5b-instruct \
    --dtype bf16 --draft-quant 4bit \
    --task humaneval --limit 20 --max-new-tokens 128 \
    --modes plain,hf_assisted,hf_prompt_lookup,specdec_adaptive,lookahead "${@:2}"
