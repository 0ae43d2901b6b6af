"""Issue 29, `distill` on the bundled pair: a pruned (or early-layer) drafter trained on the 1.5B target's own
continuations, against the unpruned 0.5B draft, on held-out prompts.

    python bench/distill_real.py --out /tmp/distill_real                          # defaults below
    python bench/distill_real.py --out /tmp/distill_real --start target_first:4    # another start
    python bench/distill_real.py --tiny --out /tmp/distill_tiny                    # smoke run, tiny pair (seconds)

One process, in order:

1. ``baseline``: ``distill(..., start="draft", steps=0)`` with the unpruned 0.5B: generates the target's
   continuations once (cached in OUT/baseline/teacher.pt) and scores the 0.5B on them (held-out greedy agreement,
   TVD, expected tokens per round at k = 1, 2, 4, 8).
2. ``distilled``: ``distill(..., start=--start, steps=--steps)`` on the same continuations (teacher.pt copied):
   the start's scores before training and the drafter's after, the training budget (steps, tokens, seconds).
3. ``c``: one draft step over one target step (``hf_specdec.models.compat.measure_costs``: medians of cached
   1-token steps after a 100-token prefix), for the 0.5B and the distilled drafter, each in fp32 (the target's
   dtype) and in dynamic int8 (the draft format ``auto`` chose on the AVX2-only EPYC).
4. ``spec``: a short speculative run per drafter (``--spec-prompts`` held-out prompts, ``--spec-tokens`` tokens,
   fixed k = 4, no prompt lookup): mean accepted length from the stats, outputs compared with plain greedy.

Prompts: training from HumanEval (``--train`` completion prompts from problem 0, ``--train-chat`` chat prompts from
problem ``--train``), held out: the first ``--heldout`` of bench/heldout.jsonl (not from HumanEval); each cut
to its last ``--max-prompt-tokens`` tokens. Writes OUT/summary.json and prints it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hf_specdec  # noqa: E402
from hf_specdec.distill import TEACHER_FILE, distill, read_prompt_source, vocab_rows  # noqa: E402
from hf_specdec.models import machine_record  # noqa: E402
from hf_specdec.models.hardware import quantize_dynamic_int8  # noqa: E402


def _spec_run(target, draft, prompts, tokens: int) -> dict:
    """Fixed k = 4, no prompt lookup: mean accepted length and parity with plain greedy."""
    accepted, rounds, drafted, new, same = 0, 0, 0, 0, 0
    for ids in prompts:
        x = torch.tensor([ids])
        plain = type(target).generate(target, x, max_new_tokens=tokens, do_sample=False)
        out = target.generate(x, custom_generate=hf_specdec.speculative_generate, draft_model=draft,
                              spec_config=hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=4,
                                                                history_lookup=False),
                              max_new_tokens=tokens, do_sample=False)
        stats = target.last_spec_stats.get()
        same += int(torch.equal(out, plain))
        accepted, drafted, rounds = accepted + stats.accepted, drafted + stats.drafted, rounds + stats.rounds
        new += stats.new_tokens
    return {"prompts": len(prompts), "tokens": tokens, "identical_to_plain": same,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": new / rounds if rounds else 0.0}  # tokens per target forward, prefill included


def _c(target, draft, tokenizer) -> dict:
    from hf_specdec.models.compat import measure_costs

    cost = measure_costs(target, draft, tokenizer, shared_vocab=min(vocab_rows(target), len(tokenizer)), max_k=1,
                         repeats=3)
    return {"c": cost["c"], "t_step_ms": cost["t_step_ms"], "t_draft_ms": cost["t_draft_ms"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--start", default="draft_spread:12")
    p.add_argument("--loss", default="tvd")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--train", type=int, default=16)
    p.add_argument("--train-chat", type=int, default=4)
    p.add_argument("--heldout", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=96)
    p.add_argument("--spec-prompts", type=int, default=2)
    p.add_argument("--spec-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="smoke run on hf_specdec.models.tiny.tiny_pair()")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.tiny:
        from hf_specdec.models.tiny import tiny_pair

        target, draft, tokenizer = tiny_pair()
        prompts = read_prompt_source("humaneval", tokenizer, args.train + args.train_chat)
    else:
        from hf_specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model

        target, tokenizer, _ = load_model(DEFAULT_TARGET, dtype="fp32")
        draft = load_model(DEFAULT_DRAFT, dtype="bf16").model  # stored bf16: its fp32 copies are the fp32 weights
        prompts = read_prompt_source("humaneval", tokenizer, args.train)
    chat = read_prompt_source("humaneval_chat", tokenizer, args.train + args.train_chat)[args.train:]
    train = (prompts[: args.train] + chat)
    heldout = read_prompt_source(str(ROOT / "bench" / "heldout.jsonl"), tokenizer, args.heldout)
    load_s = time.perf_counter() - t0
    common = dict(tokenizer=tokenizer, heldout=heldout, continuation_tokens=args.tokens,
                  max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size, lr=args.lr, loss=args.loss)

    baseline = distill(target, draft, train, start="draft", steps=0, output_dir=out / "baseline", **common)
    baseline = dataclasses.replace(baseline, drafter=None)  # its fp32 copy of the 0.5B: freed while training
    gc.collect()
    (out / "distilled").mkdir(exist_ok=True)
    shutil.copy(out / "baseline" / TEACHER_FILE, out / "distilled" / TEACHER_FILE)
    summary = {"machine": machine_record("cpu"),
               "load_s": load_s, "baseline": baseline.to_dict()}
    report = distill(target, draft, train, start=args.start, steps=args.steps, output_dir=out / "distilled",
                     save_every=25, resume=True, **common)
    summary["distilled"] = report.to_dict()
    print(report.summary(), flush=True)
    heldout_ids = [list(ids)[-args.max_prompt_tokens:] for ids in heldout[: args.spec_prompts]]
    base_model = copy.deepcopy(draft).float().eval()  # the 0.5B in fp32, as the baseline scored it
    summary["c"] = {"draft_0.5b": _c(target, base_model, tokenizer), "distilled": _c(target, report.drafter, tokenizer)}
    for name, model in (("draft_0.5b", base_model), ("distilled", report.drafter)):  # the format auto picks here
        int8 = quantize_dynamic_int8(copy.deepcopy(model))
        summary["c"][f"{name}_dynamic_int8"] = _c(target, int8, tokenizer)
        del int8
    summary["spec"] = {"draft_0.5b": _spec_run(target, base_model, heldout_ids, args.spec_tokens),
                       "distilled": _spec_run(target, report.drafter, heldout_ids, args.spec_tokens)}
    summary["total_s"] = time.perf_counter() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    del base_model
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
