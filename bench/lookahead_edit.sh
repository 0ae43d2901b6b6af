#!/usr/bin/env bash
# docs/benchmarks.md "Lookahead decoding", edits (eval's humaneval_edit): prompt lookup, lookahead cold and with
# memory, no draft; 20 problems, 128 tokens. bash bench/lookahead_edit.sh [OUT] [more eval flags]
cd "$(dirname "$0")/.." && exec python -m eval run --out "${1:-results/lookahead_edit}" \
    --target bundle:qwen2.5-coder-1.5b-instruct --dtype bf16 \
    --task humaneval_edit --limit 20 --max-new-tokens 128 \
    --modes plain,hf_prompt_lookup,lookahead,lookahead_warm "${@:2}"
