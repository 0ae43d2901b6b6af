"""Issue 29, `distill` on the bundled pair: a drafter cut from the 0.5B draft (or another start) trained on the 1.5B
target's own continuations, against the unpruned 0.5B, on held-out prompts.

    python bench/distill_real.py --out /tmp/distill_real                         # every stage, in one process
    python bench/distill_real.py --out /tmp/distill_real --stage teacher         # or one stage per process:
    python bench/distill_real.py --out /tmp/distill_real --stage train           #   the target is not in memory
    python bench/distill_real.py --out /tmp/distill_real --stage costs           #   while the drafter trains
    python bench/distill_real.py --target smollm2-135m-instruct --draft none --start target_first:8 \
        --target-dtype fp32 --out /tmp/distill_smollm                            # no sibling: the target's layers
    python bench/distill_real.py --tiny --out /tmp/distill_tiny --start draft_spread:1 --steps 4   # smoke run

Stages (``--stage``, each reads what the earlier ones wrote in OUT; ``all`` runs them in order):

1. ``teacher``: the target (``--target-dtype``; the bundle is stored in bf16, so bf16 is its exact weights in half
   the memory of fp32) continues every prompt once: ``prepare_teacher`` writes OUT/teacher/teacher.pt.
2. ``train``: without the target in memory (``distill(None, ...)`` reads teacher.pt): ``baseline``, the unpruned
   0.5B scored on the continuations (``start="draft"``, no steps), then ``distilled``, ``--start`` trained for
   ``--steps`` (resumable: rerun the stage after an interruption): held-out greedy agreement, TVD and expected
   tokens per round at k = 1, 2, 4, 8 before and after, and the training budget.
3. ``costs``: c, one draft step over one target fp32 step, measured on proxies of each model's shapes
   (``hf_specdec.models.measure.measure_format``, as the hardware profile measures: no weights loaded) for the
   0.5B and the distilled drafter in fp32 and dynamic int8 (the draft format ``auto`` chose on the AVX2-only EPYC).
4. ``spec`` (not in ``all``; needs the target in fp32 and both drafters at once): a short speculative run per
   drafter (``--spec-prompts`` held-out prompts, ``--spec-tokens`` tokens, fixed k = 4, no prompt lookup): mean
   accepted length from the stats, outputs compared with plain greedy.
5. ``speed`` (not in ``all``): what a user sees. The pair as ``load_pair`` loads it (``auto``), the distilled
   drafter in the 0.5B draft's chosen format; plain ``generate``, then the README path with each drafter (a
   fresh ``enable`` before every call: a script's first call, no warm-up), interleaved per held-out prompt
   (``--spec-prompts``, ``--speed-tokens`` new tokens) in a balanced order (``eval/interleave.py``); total tokens
   over total seconds, acceptance, and c as measured in those calls (draft seconds per draft forward over plain
   seconds per token).

Prompts: training from HumanEval (``--train`` completion prompts from problem 0, ``--train-chat`` chat prompts from
problem ``--train``), held out: the first ``--heldout`` of bench/heldout.jsonl (not from HumanEval); each cut to
its last ``--max-prompt-tokens`` tokens. Each stage adds its part to OUT/summary.json and prints it.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eval.interleave import order as run_order  # noqa: E402
import hf_specdec  # noqa: E402
from hf_specdec.distill import TEACHER_FILE, DraftStart, cut_config, distill, prepare_teacher  # noqa: E402
from hf_specdec.distill import read_prompt_source  # noqa: E402
from hf_specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET, machine_record  # noqa: E402

STAGES = ("teacher", "train", "costs")


def _models(args, *, target_dtype: str | None):
    """(target or None, draft or None, tokenizer): the target only when ``target_dtype`` is given."""
    if args.tiny:
        from hf_specdec.models.tiny import tiny_pair

        target, draft, tokenizer = tiny_pair()
        return (target if target_dtype else None), draft, tokenizer
    from hf_specdec.models import load_model

    target, draft, tokenizer = None, None, None
    if target_dtype:
        target, tokenizer, _ = load_model(args.target, dtype=target_dtype)
    if args.draft != "none":
        draft, draft_tokenizer, _ = load_model(args.draft, dtype="bf16")  # stored bf16: fp32 copies are exact
        tokenizer = tokenizer or draft_tokenizer
    if tokenizer is None:
        from hf_specdec.models import resolve_reference
        from hf_specdec.models.refs import load_tokenizer

        tokenizer = load_tokenizer(resolve_reference(args.target))
    return target, draft, tokenizer


def _prompts(args, tokenizer):
    train = read_prompt_source("humaneval", tokenizer, args.train)
    train += read_prompt_source("humaneval_chat", tokenizer, args.train + args.train_chat)[args.train:]
    heldout = read_prompt_source(str(ROOT / "bench" / "heldout.jsonl"), tokenizer, args.heldout)
    return train, heldout


def _common(args, tokenizer, heldout) -> dict:
    return dict(tokenizer=tokenizer, heldout=heldout, continuation_tokens=args.tokens,
                max_prompt_tokens=args.max_prompt_tokens, progress=True)


def stage_teacher(args, out: Path) -> dict:
    t0 = time.perf_counter()
    target, _, tokenizer = _models(args, target_dtype=args.target_dtype)
    train, heldout = _prompts(args, tokenizer)
    load_s = time.perf_counter() - t0
    teacher = prepare_teacher(target, train, output_dir=out / "teacher", **_common(args, tokenizer, heldout))
    return {"target_dtype": args.target_dtype, "load_s": load_s, "seconds": teacher.seconds,
            "train": len(teacher.train), "heldout": len(teacher.heldout), "format": str(teacher.format),
            "continuation_tokens": sum(e.new_tokens for e in (*teacher.train, *teacher.heldout))}


def stage_train(args, out: Path) -> dict:
    start = DraftStart.parse(args.start)
    # a draft* start trains without the target in memory (distill(None, ...) reads teacher.pt); the others need it
    target, draft, tokenizer = _models(args, target_dtype=None if start.kind.needs_draft else args.target_dtype)
    train, heldout = _prompts(args, tokenizer)
    common = dict(_common(args, tokenizer, heldout), batch_size=args.batch_size, lr=args.lr, loss=args.loss)
    result = {}
    for name in ("baseline", "distilled"):
        (out / name).mkdir(parents=True, exist_ok=True)
        shutil.copy(out / "teacher" / TEACHER_FILE, out / name / TEACHER_FILE)
    if draft is not None:  # the unpruned draft scored on the same continuations
        baseline = distill(target, draft, train, start="draft", steps=0, output_dir=out / "baseline", **common)
        result["baseline"] = baseline.to_dict()
        del baseline  # its fp32 copy of the draft
    report = distill(target, draft, train, start=start, steps=args.steps, output_dir=out / "distilled",
                     save_every=args.save_every, resume=True, **common)
    print(report.summary(), flush=True)
    result["distilled"] = report.to_dict()
    return result


def stage_costs(args, out: Path) -> dict:
    from hf_specdec.models.measure import measure_format

    if args.tiny:
        from hf_specdec.models.tiny import tiny_pair

        target, draft, _ = tiny_pair()
        target_config, draft_config = target.config, draft.config
    else:
        from hf_specdec.models import config_of

        target_config, _ = config_of(args.target)
        draft_config = None if args.draft == "none" else config_of(args.draft)[0]
    start = DraftStart.parse(args.start)
    base = draft_config if start.kind.needs_draft else target_config  # the start's shapes: what c depends on
    pruned_config = cut_config(base, start.layer_indices(base.num_hidden_layers))
    target_step = dict(measure_format(target_config, "target", "fp32", sizes=(1,)).step)[1]
    result = {"target_fp32_step_ms": target_step * 1e3, "c": {}}
    for name, config in (("draft", draft_config), ("distilled", pruned_config)):
        if config is None:
            continue
        for fmt in ("fp32", "dynamic-int8"):
            step = dict(measure_format(config, "draft", fmt, sizes=(1,), read_tokens=()).step)[1]
            result["c"][f"{name}_{fmt}"] = {"step_ms": step * 1e3, "c": step / target_step}
    return result


def stage_spec(args, out: Path) -> dict:
    from hf_specdec.models import load_model

    target, draft, tokenizer = _models(args, target_dtype="fp32")
    _, heldout = _prompts(args, tokenizer)
    prompts = [list(ids)[-args.max_prompt_tokens:] for ids in heldout[: args.spec_prompts]]
    drafters = {"draft": copy.deepcopy(draft).float().eval(),
                "distilled": load_model(str(out / "distilled"), dtype="fp32").model}
    result = {}
    for name, drafter in drafters.items():
        accepted, rounds, drafted, new, same = 0, 0, 0, 0, 0
        for ids in prompts:
            x = torch.tensor([ids])
            plain = type(target).generate(target, x, max_new_tokens=args.spec_tokens, do_sample=False)
            got = target.generate(x, custom_generate=hf_specdec.speculative_generate, draft_model=drafter,
                                  spec_config=hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=4,
                                                                    history_lookup=False),
                                  max_new_tokens=args.spec_tokens, do_sample=False)
            stats = target.last_spec_stats.get()
            same += int(torch.equal(got, plain))
            accepted, drafted, rounds, new = (accepted + stats.accepted, drafted + stats.drafted,
                                              rounds + stats.rounds, new + stats.new_tokens)
        result[name] = {"prompts": len(prompts), "tokens": args.spec_tokens, "identical_to_plain": same,
                        "acceptance_rate": accepted / drafted if drafted else 0.0,
                        "mean_accepted_length": new / rounds if rounds else 0.0}  # per target forward, prefill in
    return result


def stage_speed(args, out: Path) -> dict:
    from hf_specdec.models import load_model, load_pair
    from hf_specdec.models.formats import model_format

    if args.tiny:
        from hf_specdec.models.tiny import tiny_pair

        target, draft, tokenizer = tiny_pair()
        distilled, fmt = load_model(str(out / "distilled"), dtype="fp32").model, "fp32"
    else:
        (target, tokenizer, _), (draft, _, draft_info) = load_pair(args.target, args.draft)
        fmt = model_format(draft)
        distilled = load_model(str(out / "distilled"), quantize=draft_info.quantize,
                               dtype="auto" if draft_info.quantize else draft_info.dtype).model
    config = target.generation_config  # greedy, every mode the same argmax path
    config.do_sample, config.temperature, config.top_k, config.top_p = False, None, None, None
    _, heldout = _prompts(args, tokenizer)
    prompts = [torch.tensor([list(ids)]) for ids in heldout[: args.spec_prompts]]
    modes = {"plain": None, "draft": draft, "distilled": distilled}
    totals = {name: {"tokens": 0, "seconds": 0.0, "identical": 0, "accepted": 0, "drafted": 0,
                     "draft_forwards": 0, "draft_s": 0.0} for name in modes}
    for i, ids in enumerate(prompts):
        order = run_order(list(modes), i)
        outputs = {}
        for name in order:
            drafter, t0 = modes[name], time.perf_counter()
            if drafter is None:
                got = type(target).generate(target, ids, max_new_tokens=args.speed_tokens)
            else:
                hf_specdec.disable(target)
                hf_specdec.enable(target)  # a fresh memory: the call a script makes once
                got = target.generate(ids, assistant_model=drafter, max_new_tokens=args.speed_tokens)
            seconds = time.perf_counter() - t0
            outputs[name] = got[0, ids.shape[1]:].tolist()
            total = totals[name]
            total["tokens"] += len(outputs[name])
            total["seconds"] += seconds
            if drafter is not None:
                stats = target.last_spec_stats.get()
                total["accepted"] += stats.accepted
                total["drafted"] += stats.drafted
                total["draft_forwards"] += stats.draft_forwards
                total["draft_s"] += stats.draft_time_s
        for name in modes:
            totals[name]["identical"] += int(outputs[name] == outputs["plain"])
    plain_step = totals["plain"]["seconds"] / max(1, totals["plain"]["tokens"])
    result = {"format": fmt, "prompts": len(prompts), "tokens": args.speed_tokens}
    for name, total in totals.items():
        rate = total["tokens"] / total["seconds"]
        record = {"tokens_per_s": rate, "vs_plain": rate * plain_step, "identical_to_plain": total["identical"],
                  "seconds": total["seconds"]}
        if name != "plain":
            record.update(acceptance=total["accepted"] / total["drafted"] if total["drafted"] else 0.0,
                          drafted=total["drafted"], draft_forwards=total["draft_forwards"],
                          c_measured=(total["draft_s"] / total["draft_forwards"] / plain_step
                                      if total["draft_forwards"] else None))
        result[name] = record
    result["distilled_vs_draft"] = result["distilled"]["tokens_per_s"] / result["draft"]["tokens_per_s"]
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--stage", default="all", choices=["all", *STAGES, "spec", "speed"])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="'none': no draft (target_first / config starts)")
    p.add_argument("--start", default="draft_spread:12")
    p.add_argument("--loss", default="tvd")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--train", type=int, default=16)
    p.add_argument("--train-chat", type=int, default=4)
    p.add_argument("--heldout", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=96)
    p.add_argument("--target-dtype", default="bf16", help="the target's dtype (the teacher stage; train, when the "
                                                          "start needs the target)")
    p.add_argument("--spec-prompts", type=int, default=2)
    p.add_argument("--spec-tokens", type=int, default=32)
    p.add_argument("--speed-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="smoke run on hf_specdec.models.tiny.tiny_pair()")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    summary["machine"] = machine_record("cpu")
    summary["args"] = vars(args)
    for stage in (STAGES if args.stage == "all" else (args.stage,)):
        t0 = time.perf_counter()
        summary[stage] = {**globals()[f"stage_{stage}"](args, out), "stage_s": time.perf_counter() - t0}
        path.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
