"""A change's before and after, in one process: an older commit of hf_specdec against this checkout, with an A/A.

    python bench/before_after.py --decoding speculative --task humaneval --limit 4 --new-tokens 64
    python bench/before_after.py --decoding lookahead --task humaneval_edit --old 47a4c17
    python bench/before_after.py --decoding speculative --task bench/heldout.jsonl   # held-out prompts
    python bench/before_after.py --decoding lookahead --tiny --limit 2                 # smoke run, tiny pair

A script, not a test ("same or better speed on the existing presets, before/after interleaved in one run with an
A/A column"). The old commit's package is exported with ``git archive`` and imported as ``hf_specdec_old``
(``old_commit.py``), so both run over the same model objects. Modes (default ``plain,old,new,old_again``):
``plain`` is transformers' greedy ``generate``; ``old`` / ``new`` / ``old_again`` each keep one memory for the
whole run, as ``enable`` would (``old_again`` is the old commit with a memory of its own: how far two runs of the
same code differ); ``new_unseeded`` (not in the default) is this checkout with a memory that is not seeded from
the hardware profile (it learns t(n) from its own forwards, as calls did before seeding); ``--cold`` gives every
call a fresh memory instead. Every mode decodes one warm-up call first (the existing presets warm up;
``bench/first_call.py`` measures the calls without one). Modes run in a balanced order per prompt
(``eval/interleave.py``: run a multiple of 4 prompts for 4 modes); throughput = total new tokens / total seconds.
A forward hook counts target forwards, their inputs and the plain (one-input) ones: where a difference comes from.
Every call is made as a user makes it, in no grad mode of the caller's (``generate`` sets its own; hf_specdec's loop
runs in inference mode, ``hf_specdec/ordinary.py``); runs before stop 41 wrapped every mode in inference mode.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # eval/, when run as bench/before_after.py

from eval.interleave import balanced, order as run_order  # noqa: E402
import hf_specdec  # noqa: E402
from hf_specdec.memory import EstimatesFrom, Seeding  # noqa: E402
from old_commit import import_old  # noqa: E402  (bench/, beside this script)

MODES = ("plain", "old", "new", "old_again", "new_unseeded")
DEFAULT_MODES = MODES[:4]


UNSEEDED = Seeding(EstimatesFrom.PRIORS, reason="bench: not seeded from the hardware profile")


def load(args):
    """(target, draft or None, tokenizer, what was loaded)."""
    if args.tiny:
        from hf_specdec.models.tiny import tiny_pair

        model, draft, tokenizer = tiny_pair(seed=0)
        info = {"target": "tiny llama fp32", "draft": "tiny perturbed copy fp32"}
    elif args.decoding == "speculative":
        from hf_specdec.models import load_pair

        (model, tokenizer, target_info), (draft, _, draft_info) = load_pair(args.target, args.draft)
        info = {"target": f"{target_info.ref} {target_info.dtype}",
                "draft": f"{draft_info.ref} {draft_info.dtype} {draft_info.quantize or ''}".strip()}
    else:
        from hf_specdec.models import load_model

        model, tokenizer, target_info = load_model(args.target, dtype="auto")
        draft, info = None, {"target": f"{target_info.ref} {target_info.dtype}"}
    config = model.generation_config
    config.do_sample, config.temperature, config.top_k, config.top_p = False, None, None, None
    return model, (None if args.decoding == "lookahead" else draft), tokenizer, info


def prompts(args, tokenizer):
    """(id, encoded inputs) of eval's task ``args.task`` (``humaneval``, ``humaneval_edit``, or a jsonl path)."""
    from eval.tasks import load_task

    spec = args.task if args.task in ("humaneval", "humaneval_edit") else f"jsonl:{args.task}"
    if args.tiny:
        texts = ["def add(a, b):\n    return", "import os\nimport sys\n", "def sub(a, b):\n    return"]
        return [(f"tiny/{i}", tokenizer(t, return_tensors="pt")) for i, t in enumerate(texts[: args.limit])]
    return [(s.id, tokenizer(s.text, return_tensors="pt", add_special_tokens=s.style != "chat"))
            for s in load_task(spec, tokenizer, args.limit)]


def main(argv=None) -> int:
    from hf_specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", default="47a4c17", help="the older commit (before the change)")
    parser.add_argument("--decoding", choices=("speculative", "lookahead"), default="speculative")
    parser.add_argument("--task", default="humaneval", help="humaneval, humaneval_edit or a jsonl of eval's format")
    parser.add_argument("--limit", type=int, default=4, help="the first N prompts")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--cold", action="store_true", help="a fresh memory every call (default: one per mode)")
    parser.add_argument("--tiny", action="store_true", help="the offline tiny pair (a smoke run)")
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; use {', '.join(MODES)}")

    with tempfile.TemporaryDirectory(prefix="hf_specdec_old_") as tmp:
        packages = {"new": hf_specdec, "old": import_old(args.old, Path(tmp))}
        packages["old_again"] = packages["old"]
        packages["new_unseeded"] = hf_specdec
        model, draft, tokenizer, loaded = load(args)
        samples = prompts(args, tokenizer)
        counts = {"forwards": 0, "inputs": 0, "plain": 0}

        def count(module, positional, keywords):
            ids = keywords.get("input_ids", positional[0] if positional else None)
            counts["forwards"] += 1
            counts["inputs"] += ids.shape[1]
            counts["plain"] += ids.shape[1] == 1

        model.register_forward_pre_hook(count, with_kwargs=True)
        generate = type(model).generate
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        common = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad)

        def memory(package, seeded=True):
            if args.decoding == "speculative":
                found = package.SpeculativeMemory()
                if not seeded:
                    found.seed(draft, origin=UNSEEDED)
                return found
            found = package.LookaheadMemory()
            if not seeded:  # an origin and no costs: the call learns t(n) from its own forwards, as 47a4c17 did
                found.seed(None, origin=UNSEEDED)
            return found

        def decoder(mode):
            if mode == "plain":
                return lambda inputs: generate(model, **inputs, **common)
            package, kept = packages[mode], memory(packages[mode], seeded=mode != "new_unseeded")
            if args.decoding == "speculative":
                return lambda inputs: generate(model, **inputs, **common, custom_generate=package.speculative_generate,
                                               draft_model=draft,
                                               speculative_memory=memory(package) if args.cold else kept)
            return lambda inputs: generate(model, **inputs, **common, custom_generate=package.lookahead_generate,
                                           lookahead_memory=memory(package) if args.cold else kept)

        runs = {mode: decoder(mode) for mode in modes}
        warm = tokenizer("def f(x):\n", return_tensors="pt")
        for run in runs.values():  # every call as a user makes it: no grad mode of the caller's (generate's own)
            run(warm)
        totals = {mode: {"tokens": 0, "seconds": 0.0, "forwards": 0, "inputs": 0, "plain": 0, "equal": 0}
                  for mode in modes}
        per_prompt = []
        for i, (sample_id, inputs) in enumerate(samples):
            outs, row = {}, {"id": sample_id}
            for mode in run_order(modes, i):
                counts.update(forwards=0, inputs=0, plain=0)
                width = inputs["input_ids"].shape[1]
                start = time.perf_counter()
                out = runs[mode](inputs)
                seconds = time.perf_counter() - start
                outs[mode] = out[0, width:].tolist()
                total = totals[mode]
                total["tokens"] += len(outs[mode])
                total["seconds"] += seconds
                total["forwards"] += counts["forwards"] - 1  # the prefill is not a round
                total["inputs"] += counts["inputs"] - width
                total["plain"] += counts["plain"]
                row[mode] = round(len(outs[mode]) / seconds, 3)
            for mode in modes:
                totals[mode]["equal"] += outs[mode] == outs.get("plain", outs[mode])
            per_prompt.append(row)
            print(json.dumps(row), file=sys.stderr)
    rate = {mode: t["tokens"] / t["seconds"] for mode, t in totals.items()}
    report = {
        "decoding": args.decoding, "task": args.task, "old": args.old, "prompts": len(samples),
        "new_tokens": args.new_tokens, "cold": args.cold, "loaded": loaded,
        "balanced_order": balanced(modes, len(samples)),  # whole Latin squares: every position and predecessor alike
        "tokens_per_s": {mode: round(r, 3) for mode, r in rate.items()},
        **{f"{mode}_vs_old": round(rate[mode] / rate["old"], 3) for mode in ("new", "old_again")
           if mode in rate and "old" in rate},
        **{f"{mode}_vs_plain": round(rate[mode] / rate["plain"], 3) for mode in ("old", "new", "old_again")
           if mode in rate and "plain" in rate},
        "per_mode": {mode: {"forwards": t["forwards"], "plain_forwards": t["plain"],
                            "tokens_per_forward": round(t["tokens"] / max(1, t["forwards"]), 2),
                            "inputs_per_forward": round(t["inputs"] / max(1, t["forwards"]), 1),
                            **({"equal_to_plain": f"{t['equal']}/{len(samples)}"} if "plain" in runs else {})}
                     for mode, t in totals.items()},
        "per_prompt_tokens_per_s": per_prompt,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
