#!/usr/bin/env bash
# docs/benchmarks.md "Defaults on this machine": every default ("auto" target dtype and draft format, the
# adaptive policy) against plain decoding in both CPU dtypes and transformers' assisted decoding in its three
# configurations, interleaved per prompt. Run it once per task: humaneval (default) and humaneval_edit.
# bash bench/defaults.sh [OUT] [more eval flags]   e.g. bash bench/defaults.sh results/defaults_edit --task humaneval_edit
cd "$(dirname "$0")/.." && exec python -m eval run --out "${1:-results/defaults}" \
    --target bundle:qwen2.5-coder-1.5b-instruct --draft bundle:qwen2.5-coder-0.5b-instruct \
    --dtype auto --draft-quant auto --plain-dtypes bf16,fp32 \
    --task humaneval --limit 6 --max-new-tokens 128 --no-analysis \
    --modes plain,hf_assisted,hf_assisted_k3,hf_assisted_k5,specdec_adaptive,lookahead "${@:2}"
