"""Static vs dynamic store: the same hf_specdec call on its dynamic store and on a static cache
(``cache_implementation="static"``: the cache's preallocated buffers, ``backends.Buffers``), interleaved.

    python bench/static_cache.py --out results/static_cache                  # bundled pair, 12 HumanEval prompts
    python bench/static_cache.py --batches 1,4 --prompts 24 --out results/static_cache_b4
    python bench/static_cache.py --tiny --out /tmp/smoke                      # smoke run: tiny random pair (seconds)

A script, not a test. HumanEval prompts (completion style), left-padded into batches of B; for each batch size
every mode decodes the same batches, modes in the orders of a balanced Latin square per batch
(``eval/interleave.py``: 6 modes balance over every 6 batches), after one warm-up call each. Greedy; every row
of every mode is checked against plain batched generate on the same padded batch (``rows_equal_to_plain``:
rows equal in full, padding included; bf16 near-ties may flip a token, fp32 is exact).

Modes:

    plain               transformers' greedy ``generate`` (its dynamic cache)
    plain_static        the same with ``cache_implementation="static"``: transformers' own static path
    speculative         hf_specdec with the draft, dynamic store
    speculative_static  the same call with ``cache_implementation="static"``
    lookahead           hf_specdec lookahead, dynamic store, cold (``lookahead_memory=None``)
    lookahead_static    the same call with ``cache_implementation="static"``

Each speculative mode has a ``SpeculativeMemory`` of its own, seeded alike from the cached hardware profile (what
a first call would do itself), so that the costs one store measures (a static forward attends over the buffer's
whole width) do not steer the other's rounds; ``--policy fixed`` drafts ``--k`` tokens every round instead of
the adaptive policy. transformers sizes a static cache by the longest call it made one for
(``_previous_max_cache_length``): every static call after the warm-up has the same width, plain's and hf_specdec's
alike. The report gives per batch size and mode: tokens, seconds, tok/s, the ratio to plain, rows equal to
plain; and per decoding the static/dynamic throughput ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # eval/, when run as bench/static_cache.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # first_call.py, beside this script

import hf_specdec  # noqa: E402
from eval.interleave import balanced, order as run_order  # noqa: E402
from batch import TINY_TEXTS, load_bench_pair, pair_arguments  # noqa: E402  (beside this script)
from first_call import machine_of, machine_words, write_report  # noqa: E402
from hf_specdec.models.seeding import seed_speculative  # noqa: E402

MODES = ("plain", "plain_static", "speculative", "speculative_static", "lookahead", "lookahead_static")
PAIRS = (("speculative", "speculative_static"), ("lookahead", "lookahead_static"), ("plain", "plain_static"))

def left_padded(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    tokenizer.padding_side = "left"
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    return encoded["input_ids"], encoded["attention_mask"]


def make_modes(target, draft, args, pad: int) -> dict:
    """Each mode's call: (input ids, mask) -> tokens."""
    greedy = dict(max_new_tokens=args.new, do_sample=False, pad_token_id=pad)
    spec = hf_specdec.SpecConfig(policy=args.policy, num_draft_tokens=args.k)
    memories = {}
    for mode in ("speculative", "speculative_static"):
        memories[mode] = hf_specdec.SpeculativeMemory()
        print(f"{mode}: {seed_speculative(memories[mode], target, draft).why}", file=sys.stderr)
    plain = type(target).generate

    def static(mode: str) -> dict:
        return {"cache_implementation": "static"} if mode.endswith("_static") else {}

    def speculative(mode):
        return lambda ids, mask: target.generate(ids, attention_mask=mask, assistant_model=draft, spec_config=spec,
                                                 speculative_memory=memories[mode], **greedy, **static(mode))

    def lookahead(mode):
        return lambda ids, mask: target.generate(ids, attention_mask=mask, decoding="lookahead",
                                                 lookahead_memory=None, **greedy, **static(mode))

    def plain_mode(mode):
        return lambda ids, mask: plain(target, ids, attention_mask=mask, **greedy, **static(mode))

    return {mode: (plain_mode if mode.startswith("plain") else speculative if mode.startswith("speculative")
                   else lookahead)(mode) for mode in args.modes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pair_arguments(parser, batches="1", prompts=12, new=128,
                   prompts_help="HumanEval prompts (HumanEval/0..N-1); a multiple of 6 x B balances the 6 modes at "
                                "batch size B")
    parser.add_argument("--policy", default="adaptive", choices=("adaptive", "fixed"))
    parser.add_argument("--k", type=int, default=4, help="draft tokens a round with --policy fixed")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default="results/static_cache")
    parser.add_argument("--tiny", action="store_true",
                        help="smoke run: tiny_pair() in fp32, one thread, batches 1 and 2 of 6 fixed prompts, 16 new "
                             "tokens")
    args = parser.parse_args(argv)
    args.modes = [mode for mode in args.modes.split(",") if mode]
    assert "plain" in args.modes and set(args.modes) <= set(MODES), f"modes: plain and any of {MODES}"
    if args.tiny:  # tiny forwards gain nothing from threads, and on a busy machine they wait for each other
        args.threads = args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        args.batches, args.prompts, args.new = "1,2", len(TINY_TEXTS), 16
    target, draft, tokenizer, pair, texts = load_bench_pair(args, TINY_TEXTS)
    pad = tokenizer.pad_token_id
    hf_specdec.enable(target)
    modes = make_modes(target, draft, args, pad)
    batches = [int(b) for b in args.batches.split(",")]
    with torch.inference_mode():  # one warm-up call each, at the widest batch (the static caches' width too)
        warm_ids, warm_mask = left_padded(tokenizer, texts[: max(batches)])
        for run in modes.values():
            run(warm_ids, warm_mask)
    results, balance = {}, {}
    for batch in batches:
        groups = [texts[i: i + batch] for i in range(0, len(texts) - batch + 1, batch)]
        balance[batch] = balanced(list(modes), len(groups))
        totals = {mode: dict(tokens=0, seconds=0.0, equal=0, rows=0) for mode in modes}
        for g, group in enumerate(groups):
            ids, mask = left_padded(tokenizer, group)
            outs = {}
            for mode in run_order(list(modes), g):
                with torch.inference_mode():
                    start = time.perf_counter()
                    out = modes[mode](ids, mask)
                    seconds = time.perf_counter() - start
                outs[mode] = out[:, ids.shape[1]:]
                totals[mode]["tokens"] += int((outs[mode] != pad).sum())
                totals[mode]["seconds"] += seconds
                print(f"B={batch} group {g} {mode}: {int((outs[mode] != pad).sum())} tokens {seconds:.2f} s",
                      file=sys.stderr, flush=True)
            for mode in modes:  # whole rows: a row that ends early is padded, as plain pads it
                width = max(outs[mode].shape[1], outs["plain"].shape[1])
                mine, theirs = (torch.nn.functional.pad(outs[m], (0, width - outs[m].shape[1]), value=pad)
                                for m in (mode, "plain"))
                totals[mode]["equal"] += int((mine == theirs).all(dim=1).sum())
                totals[mode]["rows"] += len(group)
        rates = {mode: row["tokens"] / row["seconds"] for mode, row in totals.items()}
        results[batch] = {mode: {"tokens": row["tokens"], "seconds": round(row["seconds"], 3),
                                 "tokens_per_s": round(rates[mode], 2),
                                 "vs_plain": round(rates[mode] / rates["plain"], 3),
                                 "rows_equal_to_plain": f"{row['equal']}/{row['rows']}"}
                          for mode, row in totals.items()}
    ratios = {batch: {dynamic: round(results[batch][static]["tokens_per_s"]
                                     / results[batch][dynamic]["tokens_per_s"], 3)
                      for dynamic, static in PAIRS if {dynamic, static} <= set(modes)} for batch in batches}
    machine = machine_of(str(next(target.parameters()).dtype).removeprefix("torch."))
    lines = [f"Static vs dynamic store, {len(texts)} prompts x {args.new} new tokens, greedy, policy {args.policy}, "
             f"{machine_words(machine)}; balanced order per batch size: {balance}", "",
             "| B | mode | tok/s | vs plain | static / dynamic | rows equal to plain |", "|---|---|---|---|---|---|"]
    for batch in batches:
        for mode, entry in results[batch].items():
            pair_ratio = next((f"{ratios[batch][dynamic]:.3f}" for dynamic, static in PAIRS
                               if static == mode and dynamic in ratios[batch]), "")
            lines.append(f"| {batch} | {mode} | {entry['tokens_per_s']:.1f} | {entry['vs_plain']:.3f} | {pair_ratio} | "
                         f"{entry['rows_equal_to_plain']} |")
    table = "\n".join(lines)
    print(table)
    write_report(args.out, "static_cache", dict(machine=machine, args=vars(args), pair=pair, balanced=balance,
                                                results=results, static_over_dynamic=ratios), table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
