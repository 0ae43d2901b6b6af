"""``hf-specdec``: models, check, generate, demo."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path


def _generate(args: argparse.Namespace) -> int:
    import torch

    import hf_specdec
    from hf_specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model

    model, tokenizer = load_model(args.target or DEFAULT_TARGET, dtype=args.dtype)
    draft = None
    if args.mode == "speculative":
        draft, _ = load_model(args.draft or DEFAULT_DRAFT, dtype=args.dtype,
                              quantize=None if args.draft_quant == "none" else args.draft_quant)
    hf_specdec.enable(model)
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = args.prompt
    inputs = tokenizer(text, return_tensors="pt")
    from transformers import TextStreamer

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = dict(max_new_tokens=args.max_new_tokens, streamer=streamer,
                  do_sample=args.temperature > 0)
    if args.temperature > 0:
        kwargs["temperature"] = args.temperature
    with torch.inference_mode():
        if args.mode == "speculative":
            model.generate(**inputs, assistant_model=draft, spec_config=hf_specdec.SpecConfig(policy=args.policy),
                           **kwargs)
        elif args.mode == "lookahead":
            model.generate(**inputs, decoding="lookahead", **kwargs)
        else:
            model.generate(**inputs, **kwargs)
    if args.mode != "plain":
        print("\n" + model.last_spec_stats.summary(), file=sys.stderr)
    return 0


def _demo(argv: list[str]) -> int:
    app_path = Path(__file__).resolve().parent.parent / "demo" / "app.py"
    if not app_path.exists():
        print(f"hf-specdec demo: {app_path} not found; run it from a checkout of the repository "
              "(pip install -e '.[demo]').", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("hf_specdec_demo_app", app_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return int(module.main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from hf_specdec.models import cli as models_cli

    models_cli.register(sub)

    gen = sub.add_parser("generate", help="generate text from a prompt with one decoding mode, streaming")
    gen.add_argument("prompt")
    gen.add_argument("--target", default=None, help="model reference (bundle name, hub id, dir, .gguf)")
    gen.add_argument("--draft", default=None)
    gen.add_argument("--draft-quant", default="4bit", choices=["4bit", "8bit", "none"])
    gen.add_argument("--mode", default="speculative", choices=["speculative", "lookahead", "plain"])
    gen.add_argument("--policy", default="adaptive", choices=["adaptive", "fixed", "heuristic"])
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.set_defaults(func=_generate)

    # `hf-specdec demo ARGS...` hands ARGS to demo/app.py untouched (see main)
    sub.add_parser("demo", help="the side-by-side Gradio demo; `hf-specdec demo --help` for its options")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:
        return _demo(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
