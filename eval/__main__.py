"""``python -m eval run ...`` / ``python -m eval report OUT``: see docs/eval.md."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

# settings that must match when a run is resumed into an existing --out
RESUME_KEYS = ("target", "draft", "draft_quant", "dtype", "device", "task", "max_new_tokens", "temperature",
               "spec_k", "lookahead")


def _limits(timeout_s: float):
    from .sandbox import Limits

    return Limits(timeout_s=timeout_s, cpu_s=max(1, math.ceil(timeout_s)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="decode a task with several modes, time them, check quality, write a report")
    r.add_argument("--target", required=True, help="model reference: bundle:NAME, hub id, local dir or .gguf")
    r.add_argument("--draft", default=None, help="draft model reference (needed by hf_assisted*, specdec_*)")
    from hf_specdec.models.cli import DRAFT_QUANTIZE_CHOICES

    r.add_argument("--draft-quant", default="auto", choices=DRAFT_QUANTIZE_CHOICES,
                   help="draft format: auto (the hardware profile's fastest that fits), a quantization, or none "
                        "(the target's dtype)")
    r.add_argument("--dtype", default="auto", help="target dtype: auto (the hardware profile's choice) | bf16 | "
                                                   "fp16 | fp32")
    r.add_argument("--plain-dtypes", default=None, metavar="LIST",
                   help="also time plain decoding of the target loaded in each of these dtypes, e.g. bf16,fp32 "
                        "(modes plain_bf16, plain_fp32, except the dtype the target was loaded in: that is 'plain'); "
                        "the report adds speed against the fastest plain decoding of each prompt")
    r.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    r.add_argument("--modes", default="plain,hf_assisted,hf_prompt_lookup,specdec_adaptive,lookahead",
                   help="comma-separated; plain is always added (the baseline)")
    r.add_argument("--task", default="humaneval", help="humaneval | humaneval_chat | humaneval_edit | jsonl:PATH")
    r.add_argument("--limit", type=int, default=None, help="first N prompts of the task")
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--repeats", type=int, default=1, help="timed repeats of every (prompt, mode)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--seeds", default=None, help="comma-separated seeds (sampling): one sample per seed")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    r.add_argument("--warmup", type=int, default=1, help="untimed warm-up rounds of every mode")
    r.add_argument("--spec-k", type=int, default=4, help="k for specdec_fixed / start k for specdec_heuristic")
    r.add_argument("--lookahead", default=None, help='LookaheadConfig as JSON, e.g. \'{"window": 5}\'')
    r.add_argument("--tie-threshold", type=float, default=None, help="near-tie logit margin (default by dtype)")
    r.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    r.add_argument("--exec-timeout", type=float, default=10.0, help="sandbox wall-clock seconds per program")
    r.add_argument("--out", required=True, help="output directory (rerun with the same --out to resume)")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--no-analysis", action="store_true", help="skip the teacher-forced oracle/margin forwards")
    rep = sub.add_parser("report", help="rebuild summary.json, report.md and plots from OUT")
    rep.add_argument("out")
    rep.add_argument("--exec-timeout", type=float, default=10.0)
    return p


def neutral_generation_config(model, temperature: float) -> None:
    """Make every mode decode the plain distribution: no repetition penalty / top-k / top-p from the model's
    shipped generation_config (Qwen2.5-Coder ships repetition_penalty=1.1, top_k=20, top_p=0.8)."""
    gc = model.generation_config
    gc.repetition_penalty = 1.0
    gc.top_k = None
    gc.top_p = None
    gc.do_sample = temperature > 0
    gc.temperature = temperature if temperature > 0 else None
    if gc.pad_token_id is None:
        eos = gc.eos_token_id
        gc.pad_token_id = eos[0] if isinstance(eos, list) else eos


def _config(args, modes: list[str], seeds: list[int]) -> dict[str, Any]:
    return {
        "target": args.target, "draft": args.draft, "draft_quant": args.draft_quant, "dtype": args.dtype,
        "device": args.device, "task": args.task, "limit": args.limit, "modes": modes,
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "spec_k": args.spec_k,
        "lookahead": args.lookahead, "plain_dtypes": args.plain_dtypes,
        "settings": {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                     "repeats": args.repeats, "seeds": seeds, "warmup": args.warmup, "spec_k": args.spec_k,
                     "lookahead": args.lookahead, "threads": args.threads},
    }


def cmd_run(args) -> int:
    import torch

    from hf_specdec import LookaheadConfig
    from hf_specdec.harness import (DRAFT_MODES, MODES, PLAIN_DTYPE_MODES, Harness, Settings, choices_record,
                                    loaded_format, machine_record, parse_modes)
    from hf_specdec.models import Workload, load_model, load_pair

    from . import report, runner
    from .analysis import analyze
    from .metrics import tie_threshold
    from .tasks import load_task

    plain_dtypes = [d.strip() for d in args.plain_dtypes.split(",") if d.strip()] if args.plain_dtypes else []
    modes = parse_modes(args.modes)
    modes += [f"plain_{d}" for d in plain_dtypes if f"plain_{d}" not in modes]
    unknown = [m for m in modes if m not in MODES and m not in PLAIN_DTYPE_MODES]
    if unknown:
        print(f"error: unknown --plain-dtypes {unknown}; known: {list(PLAIN_DTYPE_MODES)}", file=sys.stderr)
        return 2
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [args.seed]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.draft is None and any(m in DRAFT_MODES for m in modes):
        print(f"error: modes {[m for m in modes if m in DRAFT_MODES]} need --draft", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(args, modes, seeds)
    old = report._load_json(out / "config.json")
    if old:
        diff = {k: (old.get(k), config[k]) for k in RESUME_KEYS if old.get(k) != config[k]}
        if diff:
            print(f"error: {out} holds a run with different settings {diff}; use another --out", file=sys.stderr)
            return 2

    workload = Workload(new_tokens=args.max_new_tokens)
    draft = draft_info = None
    if args.draft:  # one hardware profile of the pair decides both formats (dtype / draft-quant "auto")
        quantize = None if args.draft_quant in (None, "none") else args.draft_quant
        (target, tokenizer, target_info), (draft, draft_tok, draft_info) = load_pair(
            args.target, args.draft, dtype=args.dtype, draft_quantize=quantize, device=args.device, workload=workload)
        if len(draft_tok) != len(tokenizer) or draft_tok.get_vocab() != tokenizer.get_vocab():
            print("warning: draft and target tokenizers differ; assisted modes may fall back or fail", file=sys.stderr)
    else:
        target, tokenizer, target_info = load_model(args.target, dtype=args.dtype, device=args.device,
                                                    workload=workload)
    # the target in each other --plain-dtypes dtype; the dtype it was loaded in is the "plain" mode already
    same = [fmt for fmt in plain_dtypes if fmt == loaded_format(target_info)]
    modes = [m for m in modes if m not in {f"plain_{fmt}" for fmt in same}]
    plain_targets = {fmt: load_model(args.target, dtype=fmt, device=args.device).model
                     for fmt in plain_dtypes if fmt not in same}
    for role, line in choices_record({"target": target_info, "draft": draft_info}).items():
        if line is not None:
            print(f"[hf_specdec] {line['line']}", file=sys.stderr)
    for model in (target, draft, *plain_targets.values()):
        if model is not None:
            neutral_generation_config(model, args.temperature)
    dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
    config.update(
        dtype_resolved=dtype,
        load_info={"target": dataclasses.asdict(target_info),
                   "draft": dataclasses.asdict(draft_info) if draft_info is not None else None},
        choices=choices_record({"target": target_info, "draft": draft_info}),
        plain_is=loaded_format(target_info),  # the dtype the "plain" mode decodes in (--plain-dtypes adds others)
        machine=machine_record(target_info.device, dtype),
        chat_template=bool(getattr(tokenizer, "chat_template", None)),
    )
    config["modes"] = [m for m in dict.fromkeys((old.get("modes") or []) + modes)]
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))

    samples = load_task(args.task, tokenizer, args.limit)
    settings = Settings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, spec_k=args.spec_k,
                        lookahead=LookaheadConfig.from_dict(json.loads(args.lookahead) if args.lookahead else {}))
    # one run, one task: one lookahead_warm memory; the speculative memory seeded from the cached profile
    with Harness(target, tokenizer, draft, settings, plain_targets=plain_targets) as harness:
        config["memory_seed"] = harness.memory_seed
        (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
        prompts = {s.id: harness.encode(s.text, add_special_tokens=s.style != "chat").input_ids for s in samples}
        rows = runner.run(lambda mode, sample, seed, n: harness.generate_row(mode, prompts[sample.id], seed, n),
                          samples, modes, out, repeats=args.repeats, seeds=seeds, warmup_rounds=args.warmup,
                          progress=not args.no_progress)
    if not args.no_analysis:
        analyze(out, rows, {sid: ids[0].tolist() for sid, ids in prompts.items()}, target, draft,
                args.tie_threshold if args.tie_threshold is not None else tie_threshold(dtype), dtype,
                args.temperature, progress=not args.no_progress)
    summary = report.build(out, progress=not args.no_progress, limits=_limits(args.exec_timeout))
    print_summary(summary, out)
    return 0


def print_summary(summary: dict, out: Path) -> None:
    speed = summary["speed"]
    qual = summary["quality"]["modes"]
    fastest = any(e.get("vs_fastest_plain") for e in speed.values())
    print(f"\n{'mode':<20} {'tok/s':>8} {'speedup':>8} {'pass@1':>7} {'exact':>6}"
          + (f" {'vs fastest plain (worst prompt)':>32}" if fastest else ""))
    for mode, e in speed.items():
        if not e.get("n_prompts"):
            print(f"{mode:<20} {'(no rows)':>8}")
            continue
        q = qual.get(mode, {})
        p = q.get("pass_at_1")
        ex = q.get("exact_rate")
        print(f"{mode:<20} {e['tokens_per_s_median']:8.2f} {e.get('speedup', 1.0):7.2f}x "
              f"{'' if p is None else f'{p:.0%}':>7} {'' if ex is None else f'{ex:.0%}':>6}"
              + (f" {e['vs_fastest_plain']:>17.2f}x ({e['per_prompt_vs_fastest_plain']['min']:.2f}x)"
                 if e.get("vs_fastest_plain") else ""))
    if summary["errors"]:
        print(f"{len(summary['errors'])} failed generations (see report)")
    print(f"report: {out / 'report.md'}")


def cmd_report(args) -> int:
    from . import report

    out = Path(args.out)
    if not (out / "rows.jsonl").exists():
        print(f"error: {out}/rows.jsonl not found", file=sys.stderr)
        return 2
    summary = report.build(out, progress=True, limits=_limits(args.exec_timeout))
    print_summary(summary, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cmd_run(args) if args.command == "run" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
