"""``python -m eval run ...`` / ``python -m eval report OUT``: see docs/eval.md."""

from __future__ import annotations

import argparse
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
    r.add_argument("--draft-quant", default=None, choices=["4bit", "8bit", "none"], help="quantize the draft")
    r.add_argument("--dtype", default="auto", help="auto | bf16 | fp16 | fp32 (both models)")
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


def load(ref: str, dtype: str, quantize: str | None, device: str):
    """Load via hf_specdec.models (any reference kind); plain transformers for a hub id / local dir if that
    package cannot be imported (then no bundles, gguf or quantization)."""
    quantize = None if quantize in (None, "none") else quantize
    try:
        from hf_specdec.models import load_model
    except ImportError as err:
        if quantize or ref.startswith("bundle:") or ref.endswith(".gguf"):
            raise
        print(f"warning: hf_specdec.models unavailable ({err}); loading {ref} with transformers", file=sys.stderr)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dt = {"auto": "auto", "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(dtype, dtype)
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=dt).eval()
        if device not in ("auto", "cpu"):
            model = model.to(device)
        elif device == "auto" and torch.cuda.is_available():
            model = model.to("cuda")
        return model, AutoTokenizer.from_pretrained(ref)
    return load_model(ref, dtype=dtype, quantize=quantize, device=device)


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
        "lookahead": args.lookahead,
        "settings": {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                     "repeats": args.repeats, "seeds": seeds, "warmup": args.warmup, "spec_k": args.spec_k,
                     "lookahead": args.lookahead, "threads": args.threads},
    }


def cmd_run(args) -> int:
    import torch

    from . import report, runner
    from .metrics import tie_threshold
    from .modes import DRAFT_MODES, Generator, Settings, machine_info, parse_modes
    from .tasks import load_task

    modes = parse_modes(args.modes)
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

    target, tokenizer = load(args.target, args.dtype, None, args.device)
    draft = None
    if args.draft:
        draft, draft_tok = load(args.draft, args.dtype, args.draft_quant, args.device)
        if len(draft_tok) != len(tokenizer) or draft_tok.get_vocab() != tokenizer.get_vocab():
            print("warning: draft and target tokenizers differ; assisted modes may fall back or fail", file=sys.stderr)
    for model in (target, draft):
        if model is not None:
            neutral_generation_config(model, args.temperature)
    dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
    config.update(
        dtype_resolved=dtype,
        load_info={"target": getattr(target, "hf_specdec_load_info", None),
                   "draft": getattr(draft, "hf_specdec_load_info", None)},
        machine=machine_info(),
        chat_template=bool(getattr(tokenizer, "chat_template", None)),
    )
    config["modes"] = [m for m in dict.fromkeys((old.get("modes") or []) + modes)]
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))

    samples = load_task(args.task, tokenizer, args.limit)
    settings = Settings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, spec_k=args.spec_k,
                        lookahead=json.loads(args.lookahead) if args.lookahead else None)
    gen = Generator(target, tokenizer, draft, settings)
    rows = runner.run(
        lambda mode, sample, seed, n: gen.generate(mode, sample.text, seed, n, chat=sample.style == "chat"),
        samples, modes, out, repeats=args.repeats, seeds=seeds, warmup_rounds=args.warmup,
        progress=not args.no_progress,
    )
    gen.close()
    if not args.no_analysis:
        analyze(out, rows, samples, target, draft, tokenizer, gen,
                args.tie_threshold if args.tie_threshold is not None else tie_threshold(dtype), dtype,
                args.temperature, args.max_new_tokens, progress=not args.no_progress)
    summary = report.build(out, progress=not args.no_progress, limits=_limits(args.exec_timeout))
    print_summary(summary, out)
    return 0


def analyze(out: Path, rows, samples, target, draft, tokenizer, gen, threshold, dtype, temperature,
            max_new_tokens, progress=True) -> None:
    """Model-side analysis, cached in OUT/analysis.json: target margins over plain greedy output, teacher-forced
    draft agreement (oracle), harness-measured costs c and v(n), and (sampling) per-row draft agreement."""
    from .modes import measure_costs, teacher_forced
    from .report import _load_json

    path = out / "analysis.json"
    analysis = _load_json(path)
    analysis.update(dtype=dtype, tie_threshold=threshold)
    margins = analysis.setdefault("margins", {})
    agreement = analysis.setdefault("draft_agreement", {})
    target_match = analysis.setdefault("target_argmax_matches_plain", {})
    sample_agreement = analysis.setdefault("sample_agreement", {})
    prompt_ids = {s.id: gen.encode(s.text, s.style == "chat")[0].tolist() for s in samples}
    first: dict[tuple, dict] = {}
    for r in rows:
        if r.get("error") or str(r["prompt_id"]) not in prompt_ids:
            continue
        key = (r["mode"], str(r["prompt_id"]), int(r["seed"]))
        if key not in first or r["repeat"] < first[key]["repeat"]:
            first[key] = r
    todo = [(k, r) for k, r in first.items() if k[0] == "plain" or (temperature > 0 and draft is not None)]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="analysis", unit="seq")
    for (mode, pid, seed), r in todo:
        pkey = f"{pid}|{seed}"
        ids = prompt_ids[pid]
        if mode == "plain" and temperature == 0 and pkey not in margins:
            tf = teacher_forced(target, ids, r["output_ids"])
            margins[pkey] = [round(m, 4) for m in tf["margin"]]
            target_match[pkey] = sum(a == b for a, b in zip(tf["argmax"], r["output_ids"])) / max(1, len(tf["argmax"]))
            if draft is not None:
                dtf = teacher_forced(draft, ids, r["output_ids"])
                agreement[pkey] = [a == b for a, b in zip(dtf["argmax"], r["output_ids"])]
        if temperature > 0 and draft is not None and f"{mode}|{pkey}" not in sample_agreement:
            dtf = teacher_forced(draft, ids, r["output_ids"])
            n = max(1, len(r["output_ids"]))
            sample_agreement[f"{mode}|{pkey}"] = sum(a == b for a, b in zip(dtf["argmax"], r["output_ids"])) / n
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if "costs" not in analysis and samples:
        analysis["costs"] = measure_costs(target, draft, prompt_ids[samples[0].id], max_n=16, sync=gen.sync)
    path.write_text(json.dumps(analysis))


def print_summary(summary: dict, out: Path) -> None:
    speed = summary["speed"]
    qual = summary["quality"]["modes"]
    print(f"\n{'mode':<20} {'tok/s':>8} {'speedup':>8} {'pass@1':>7} {'exact':>6}")
    for mode, e in speed.items():
        if not e.get("n_prompts"):
            print(f"{mode:<20} {'(no rows)':>8}")
            continue
        q = qual.get(mode, {})
        p = q.get("pass_at_1")
        ex = q.get("exact_rate")
        print(f"{mode:<20} {e['tokens_per_s_median']:8.2f} {e.get('speedup', 1.0):7.2f}x "
              f"{'' if p is None else f'{p:.0%}':>7} {'' if ex is None else f'{ex:.0%}':>6}")
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
