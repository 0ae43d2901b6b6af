"""The int4 draft format beside the others (issue 29): the 0.5B draft's cached step per format, and how often
its greedy token agrees with the target's on held-out prompts.

    python bench/int4_draft.py --out results/int4_draft               # the bundled pair, 6 held-out prompts
    python bench/int4_draft.py --prompts 2 --rounds 2 --out /tmp/i4   # quicker
    python bench/int4_draft.py --skip-timing --formats int4 --out results/int4_draft   # reuses the target's
                                                                      # continuations saved there

Formats (``--formats``): fp32, bf16, dynamic-int8 (``load_model``'s quantize), int4 (``hf_specdec.models.int4``:
every decoder Linear in 4 bits, the output layer in bf16), int4+head (the output layer in 4 bits too; not a load
format: hf_specdec reads a draft's float output layer), nf4 (bitsandbytes, not in the default list).

Timing: one cached step, one new token on top of a ``--context``-token cache of real prompt tokens, rolled back
after each step; per format twice: with the full output layer (what the hardware profile measures) and with the
output layer narrowed as hf_specdec drafts (``SubVocabHead``: the first 32768 ids, the prompt's and the special
tokens; where the output layer is float), and the prompt read (a ``--read``-token prefill). Rounds interleave
the formats (``--rounds``, each sample the median of ``--repeats`` steps); the table gives each format's fastest
round and the median round (other processes share the CPU: they only ever add time).

Agreement: the fp32 target's greedy continuation (``--new`` tokens) of each prompt, then per format one forward
over prompt + continuation: the share of continuation positions where the draft's argmax is the target's token
(greedy acceptance per token, teacher-forced: each position sees the target's prefix), and where it is the fp32
draft's argmax (what quantizing changed). The full output layer is used.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eval.interleave import order as run_order  # noqa: E402
from hf_specdec import cache as kv  # noqa: E402
from hf_specdec.config import AUTO_DRAFT_VOCAB  # noqa: E402
from hf_specdec.drafters.draft_model import SubVocabHead  # noqa: E402
from hf_specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model  # noqa: E402
from hf_specdec.models.hardware import footprint_bytes, machine_record  # noqa: E402
from hf_specdec.models.int4 import quantize_int4  # noqa: E402
from hf_specdec.models.refs import load_tokenizer, resolve_reference  # noqa: E402

NARROW = AUTO_DRAFT_VOCAB  # SpecConfig.draft_vocab_size "auto" for a vocabulary over 65536


FORMATS = ("fp32", "bf16", "dynamic-int8", "int4", "int4+head", "nf4")
LOAD_ARGS = {"fp32": dict(dtype="fp32"), "bf16": dict(dtype="bf16"), "dynamic-int8": dict(quantize="dynamic-int8"),
             "int4": dict(quantize="int4"), "int4+head": dict(dtype="bf16"), "nf4": dict(quantize="4bit")}


def load_draft(name: str):
    model = load_model(DEFAULT_DRAFT, progress=False, **LOAD_ARGS[name]).model
    if name == "int4+head":
        quantize_int4(model, lm_head=True)
    return model


def prompt_ids(tokenizer, rows: list[dict]) -> list[torch.LongTensor]:
    out = []
    for row in rows:
        if row.get("chat"):
            text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                                 add_generation_prompt=True)
        else:
            text = row["prompt"]
        out.append(tokenizer(text, return_tensors="pt").input_ids)
    return out


@torch.inference_mode()
def step_seconds(model, prefix: torch.LongTensor, repeats: int, head) -> float:
    """Median seconds of one cached step (one new token after ``prefix``), rolled back after each."""
    cache = kv.new_cache(model)
    kv.call_model(model, prefix[:, :-1], cache, head=head)
    base = prefix.shape[1] - 1
    samples = []
    for repeat in range(repeats + 1):
        start = time.perf_counter()
        kv.call_model(model, prefix[:, -1:], cache, logits_at=1, head=head)
        if repeat:
            samples.append(time.perf_counter() - start)
        kv.rollback(cache, base)
    return statistics.median(samples)


@torch.inference_mode()
def read_seconds(model, ids: torch.LongTensor) -> float:
    cache = kv.new_cache(model)
    start = time.perf_counter()
    kv.call_model(model, ids, cache, logits_at=1)
    return time.perf_counter() - start


def narrowed_head(model, prefix: torch.LongTensor, tokenizer):
    if not SubVocabHead.usable(model):
        return None
    vocab = model.get_output_embeddings().weight.shape[0]
    specials = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    keep = torch.cat([torch.arange(NARROW), prefix[0], specials])
    return SubVocabHead(model, torch.unique(keep[keep < vocab]), vocab)


@torch.inference_mode()
def agreement(model, sequences, prompt_lengths, target_tokens, reference_tokens=None):
    """(share agreeing with the target, share agreeing with the reference draft, this draft's argmaxes)."""
    hits = ref_hits = total = 0
    argmaxes = []
    for seq, n, tgt, i in zip(sequences, prompt_lengths, target_tokens, range(len(sequences))):
        logits = model(seq).logits[0, n - 1: -1].float()  # predictions of the continuation's tokens
        guess = logits.argmax(-1)
        argmaxes.append(guess)
        hits += int((guess == tgt).sum())
        total += tgt.numel()
        if reference_tokens is not None:
            ref_hits += int((guess == reference_tokens[i]).sum())
    return hits / total, (ref_hits / total if reference_tokens is not None else 1.0), argmaxes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6, help="held-out prompts (bench/heldout.jsonl), default 6")
    parser.add_argument("--new", type=int, default=48, help="target tokens per prompt for agreement (48)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved timing rounds (4)")
    parser.add_argument("--repeats", type=int, default=5, help="steps per timing sample (5)")
    parser.add_argument("--context", type=int, default=100, help="cached tokens before the timed step (100)")
    parser.add_argument("--read", type=int, default=64, help="prompt-read (prefill) tokens timed (64)")
    parser.add_argument("--formats", default="fp32,bf16,dynamic-int8,int4,int4+head",
                        help=f"comma-separated, of {', '.join(FORMATS)} (default: all but nf4)")
    parser.add_argument("--skip-agreement", action="store_true", help="timing only")
    parser.add_argument("--skip-timing", action="store_true", help="agreement only")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=None, help="directory for int4_draft.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    rows = [json.loads(line) for line in (ROOT / "bench" / "heldout.jsonl").read_text().splitlines() if line.strip()]
    # alternate completions and edits
    completes = [r for r in rows if "/complete/" in r["id"]]
    edits = [r for r in rows if "/complete/" not in r["id"]]
    chosen = [r for pair in zip(completes, edits) for r in pair][: args.prompts]
    result: dict = {"machine": machine_record("cpu"), "args": {k: str(v) for k, v in vars(args).items()},
                    "prompts": [r["id"] for r in chosen]}

    tokenizer = load_tokenizer(resolve_reference(DEFAULT_TARGET, progress=False))
    prompts = prompt_ids(tokenizer, chosen)
    sequences, target_tokens = [], []
    saved = args.out / "target_continuations.pt" if args.out else None  # reused: 30 min on a busy 2-core CPU
    if not args.skip_agreement and saved is not None and saved.exists():
        stored = torch.load(saved)
        assert stored["prompts"] == result["prompts"] and stored["new"] == args.new, "another run's continuations"
        sequences = stored["sequences"]
    elif not args.skip_agreement:
        target = load_model(DEFAULT_TARGET, dtype="fp32", progress=False).model
        t0 = time.perf_counter()
        for ids in prompts:
            sequences.append(type(target).generate(target, ids, max_new_tokens=args.new, do_sample=False,
                                                   attention_mask=torch.ones_like(ids)))
        print(f"target continuations: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        del target
        gc.collect()
        if saved is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save({"prompts": result["prompts"], "new": args.new, "sequences": sequences}, saved)
    target_tokens = [seq[0, ids.shape[1]:] for seq, ids in zip(sequences, prompts)]

    names = args.formats.split(",")
    unknown = set(names) - set(FORMATS)
    if unknown:
        parser.error(f"--formats: unknown {', '.join(sorted(unknown))}")
    drafts = {name: load_draft(name) for name in names}
    result["footprint_bytes"] = {name: footprint_bytes(m) for name, m in drafts.items()}
    if not args.skip_agreement:
        lengths = [ids.shape[1] for ids in prompts]
        reference_model = drafts["fp32"] if "fp32" in drafts else load_draft("fp32")
        fp32_with_target, _, reference = agreement(reference_model, sequences, lengths, target_tokens)
        del reference_model
        gc.collect()
        result["agreement"] = {}
        for name, model in drafts.items():
            with_target, with_fp32, _ = (agreement(model, sequences, lengths, target_tokens, reference)
                                         if name != "fp32" else (fp32_with_target, 1.0, None))
            result["agreement"][name] = {"target": with_target, "fp32_draft": with_fp32,
                                         "positions": sum(t.numel() for t in target_tokens)}
            print(f"agreement {name:13s} target {with_target:.3f}  fp32 draft {with_fp32:.3f}", file=sys.stderr)

    if args.skip_timing:
        return _write(result, args.out)
    prefix = prompts[0][:, : args.context] if prompts[0].shape[1] >= args.context else \
        torch.cat([prompts[0], prompts[1]], dim=1)[:, : args.context]
    read_ids = torch.cat(prompts, dim=1)[:, : args.read]
    heads = {name: narrowed_head(m, prefix, tokenizer) for name, m in drafts.items()}
    samples: dict = {name: {"full": [], "narrowed": [], "read": []} for name in drafts}
    for rnd in range(args.rounds):
        order = run_order(list(drafts), rnd)  # the next order of a balanced square
        for name in order:
            model = drafts[name]
            samples[name]["full"].append(step_seconds(model, prefix, args.repeats, None))
            if heads[name] is not None:
                samples[name]["narrowed"].append(step_seconds(model, prefix, args.repeats, heads[name]))
            samples[name]["read"].append(read_seconds(model, read_ids))
        print(f"round {rnd + 1}: " + ", ".join(f"{n} {samples[n]['full'][-1] * 1e3:.0f}" for n in drafts) + " ms",
              file=sys.stderr)
    result["samples_s"] = samples
    lines = [f"| format | step, full head (ms) | step, narrowed head (ms) | prompt read {args.read} tok (ms) | "
             "agrees with target | agrees with fp32 draft | weights (MB) |", "|---|---|---|---|---|---|---|"]

    def cell(values):
        return f"{min(values) * 1e3:.0f} (median {statistics.median(values) * 1e3:.0f})" if values else "n/a"

    for name in drafts:
        s = samples[name]
        agree = result.get("agreement", {}).get(name)
        lines.append(f"| {name} | {cell(s['full'])} | {cell(s['narrowed'])} | {cell(s['read'])} | "
                     + (f"{agree['target']:.3f} | {agree['fp32_draft']:.3f}" if agree else "- | -")
                     + f" | {result['footprint_bytes'][name] / 1e6:.0f} |")
    table = "\n".join(lines)
    print(table)
    result["table"] = table
    return _write(result, args.out)


def _write(result: dict, out: Path | None) -> int:
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "int4_draft.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
