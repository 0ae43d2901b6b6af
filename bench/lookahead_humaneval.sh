#!/usr/bin/env bash
# docs/benchmarks.md "Lookahead decoding", completions: prompt lookup, lookahead cold and with memory (one
# LookaheadMemory for the run), no draft; 20 problems, 128 tokens. bash bench/lookahead_humaneval.sh [OUT] [flags]
cd "$(dirname "$0")/.." && exec python -m eval run --out "${1:-results/lookahead_humaneval}" \
    --target bundle:qwen2.5-coder-1.5b-instruct --dtype bf16 \
    --task humaneval --limit 20 --max-new-tokens 128 \
    --modes plain,hf_prompt_lookup,lookahead,lookahead_warm "${@:2}"
