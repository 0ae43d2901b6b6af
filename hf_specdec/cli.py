"""``hf-specdec``: models, check, tune, generate, distill, demo."""

from __future__ import annotations

import argparse
import sys

GENERATE_MODES = ("speculative", "lookahead", "plain")  # speculative = specdec_{--policy}; or any harness mode


def _generate(args: argparse.Namespace) -> int:
    from hf_specdec.harness import MODES, Harness, IncrementalText, RoundStreamer, Settings, choice_line
    from hf_specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET, Workload, load_model, load_pair
    from hf_specdec.models import read_profile_file
    from hf_specdec.stats import last_spec_stats

    mode = MODES[f"specdec_{args.policy}" if args.mode == "speculative" else args.mode]
    workload = Workload(new_tokens=args.max_new_tokens)
    profile = read_profile_file(args.profile) if args.profile else None
    draft = None
    if mode.needs_draft:
        quantize = None if args.draft_quant == "none" else args.draft_quant
        (model, tokenizer, target_info), (draft, _, draft_info) = load_pair(
            args.target or DEFAULT_TARGET, args.draft or DEFAULT_DRAFT, dtype=args.dtype, draft_quantize=quantize,
            workload=workload, profile=profile)
        infos = (("target", target_info), ("draft", draft_info))
    else:
        model, tokenizer, target_info = load_model(args.target or DEFAULT_TARGET, dtype=args.dtype, workload=workload,
                                                   profile=profile)
        infos = (("target", target_info),)
    for role, info in infos:  # what was loaded in which format, and why (the profile's choice, or as asked)
        print(f"[hf_specdec] {choice_line(role, info)}", file=sys.stderr)
        if info.choice is not None and info.choice.split:
            print(f"[hf_specdec] {role} note: {info.choice.split}", file=sys.stderr)
    text = IncrementalText(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))

    def show(ids: list[int], accepted: int, t: float, paths: int | None) -> None:
        sys.stdout.write(text.append(ids))
        sys.stdout.flush()

    settings = Settings(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    with Harness(model, tokenizer, draft, settings, profile=profile) as harness:
        if harness.memory_seed is not None:
            print(f"[hf_specdec] speculative memory {harness.memory_seed['why']}", file=sys.stderr)
        prompt = harness.encode(args.prompt, chat=args.chat)
        row = harness.generate_row(mode.name, prompt.input_ids, seed=args.seed,
                                   streamer=RoundStreamer(on_chunk=show, sync=harness.sync))
    print(text.flush())
    ttft = "n/a" if row["ttft_s"] is None else f"{row['ttft_s']:.2f} s"
    print(f"[{mode.title}] {row['new_tokens']} tokens in {row['e2e_s']:.2f} s ({row['tokens_per_s'] or 0:.2f} "
          f"tokens/s), TTFT {ttft}, mean accepted length {row['mean_accepted_length'] or 0:.2f}, prompt "
          f"{row['prompt_tokens']} tokens", file=sys.stderr)
    stats = last_spec_stats(model) if mode.hf_specdec else None
    if stats is not None:
        print(stats.summary(), file=sys.stderr)
        if args.verbose:  # where the time went and why rounds were plain, one line each
            for line in stats.explain():
                print(f"[hf_specdec] {line}", file=sys.stderr)
    return 0


def _demo(argv: list[str]) -> int:
    try:
        from hf_specdec.demo import app
    except ModuleNotFoundError as err:
        if err.name not in ("gradio", "matplotlib"):
            raise
        print(f"hf-specdec demo needs {err.name}: pip install 'hf_specdec[demo]'", file=sys.stderr)
        return 2
    return int(app.main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    from hf_specdec import distill
    from hf_specdec.config import PolicyKind
    from hf_specdec.harness import MODES
    from hf_specdec.models import cli as models_cli

    parser = argparse.ArgumentParser(prog="hf-specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    models_cli.register(sub)

    gen = sub.add_parser("generate", help="generate text from a prompt with one decoding mode, streaming")
    gen.add_argument("prompt")
    gen.add_argument("--target", default=None, help="model reference (bundle name, hub id, dir, .gguf)")
    gen.add_argument("--draft", default=None, help="draft reference (modes that use a draft)")
    gen.add_argument("--draft-quant", default="auto", choices=models_cli.DRAFT_QUANTIZE_CHOICES,
                     help="draft format: auto (the hardware profile's fastest that fits), 4bit, 8bit, dynamic-int8, "
                          "int4, fp32-packed or none (the target's dtype)")
    gen.add_argument("--mode", default="speculative", choices=[*GENERATE_MODES, *(m for m in MODES if m not in
                                                                                 GENERATE_MODES)],
                     help="speculative (hf_specdec with --policy), lookahead, plain, or any eval harness mode")
    gen.add_argument("--policy", default=PolicyKind.ADAPTIVE.value, choices=[kind.value for kind in PolicyKind],
                     help="how speculative mode sizes the draft (SpecConfig.policy)")
    gen.add_argument("--dtype", default="auto", help="target dtype: auto (measured choice), bf16, fp16, fp32")
    gen.add_argument("--profile", default=None, metavar="FILE",
                     help="hardware profile JSON (hf-specdec tune --json) for the auto choices, instead of the cached "
                          "one (measured once when missing)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("-v", "--verbose", action="store_true",
                     help="after the text, where the time went and why rounds were plain (speculation off)")
    gen.set_defaults(func=_generate)
    distill.register(sub)

    # `hf-specdec demo ARGS...` hands ARGS to hf_specdec.demo.app.main untouched (see main)
    sub.add_parser("demo", help="the side-by-side Gradio demo; `hf-specdec demo --help` for its options")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:
        return _demo(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
