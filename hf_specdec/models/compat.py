"""``hf-specdec check``: can this draft speed up this target here, and with which k?

Four questions, in order:

1. Tokenizers: the draft must map every token to the same id as the target. Vocabulary sizes that differ only
   by padding rows (Qwen2.5 7B: 152,064 rows, 0.5B: 151,936, same tokenizer) are compatible: the decoding loop
   compares logits over the shared vocabulary. Anything else is refused with the reason.
2. Size: the parameter ratio, next to the common "draft ~1/50 of the target" guidance. It is a proxy; what
   matters is measured next.
3. Cost on this hardware: ``c`` = draft forward time per token / target step time, and the verify-cost curve
   ``v(k)`` = target forward time over k+1 new tokens / over 1 token, both on top of a ~100-token prefix,
   median of a few repeats (``hf_specdec.costmodel.forward_times``, the one offline probe).
4. Acceptance on a few prompts, by teacher forcing: the target generates greedily, then one draft forward over
   the same sequence gives the draft's argmax at every position; ``alpha`` is the per-token agreement. Under
   greedy decoding a chain of draft tokens starting at position i is accepted up to the first disagreement,
   so the run lengths of agreement give the per-position acceptance and the measured E(k) exactly.

Predicted speedup for k draft tokens per round::

    speedup(k) = E(k) / ((k * t_draft + t_verify(k + 1)) / t_step) = E(k) / (k * c + v(k))

with E(k) = (1 - alpha^(k+1)) / (1 - alpha) (i.i.d. acceptance) or the measured run-length mean.

Before loading anything, the check takes the hardware profile of the pair (``hf_specdec.models.store``: measured
once per model, device and torch version, then cached; ``tune`` refreshes it) and reports what ``dtype="auto"``
and ``quantize="auto"`` choose from it and why (``choose``); the models are loaded as chosen (or as asked).

It stands on the rest of ``hf_specdec.models`` (the cost probe is ``measure.measure_costs``, the machine record
``hardware.machine_record``) and imports nothing of the harness, which stands on models.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from typing import Any, Sequence

import torch

from ..costmodel import (Bound, ForwardCost, RoundCost, agreement_runs, best_round, expected_tokens, prefix_gains,
                         run_length_tokens, runs_that_fit)
from ..round import SourceKind, prior_acceptance
from .bundles import BUNDLES
from .choose import Workload, choose_draft_format, choose_dtype
from .formats import model_format
from .hardware import available_memory_bytes, cpu_has_bf16, footprint_bytes, machine_record, resolve_device
from .loading import load_pair
from .measure import measure_costs as probe_costs
from .profile import HardwareProfile
from .refs import load_config, load_tokenizer, reference_kind, resolve_reference
from .store import get_profile

SCHEMA = "hf_specdec.check/3"
# vLLM V1 dropped draft-model speculation and re-added it as "method": "draft_model" (PR #24322); 0.13.0 still
# raises "Speculative decoding with draft model is not supported yet" (vllm-project/vllm#31883)
VLLM_MIN_VERSION = "0.14"
VLLM_NOTE = f"valid for vLLM >= {VLLM_MIN_VERSION} (draft_model method re-added by PR #24322); 0.10-0.13 reject it"
RATIO_GUIDANCE = 1 / 50

BUILTIN_PROMPTS = [
    "def is_prime(n: int) -> bool:\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return it as a dict, or {} if it does not exist.\"\"\"\n",
    "class Stack:\n    \"\"\"A last-in first-out stack backed by a Python list.\"\"\"\n\n    def __init__(self):\n",
]


# ----------------------------------------------------------------------------------------------------------
# 1. tokenizers


def vocab_rows(model_or_config) -> int:
    """Rows of the input embedding of a model, or ``vocab_size`` of a config."""
    if isinstance(model_or_config, torch.nn.Module):
        return int(model_or_config.get_input_embeddings().weight.shape[0])
    cfg = model_or_config
    size = getattr(cfg, "vocab_size", None)
    if size is None and hasattr(cfg, "get_text_config"):
        size = getattr(cfg.get_text_config(), "vocab_size", None)
    return int(size)


def tokenizer_compatibility(target_tokenizer, draft_tokenizer, target_rows: int, draft_rows: int) -> dict:
    """Compare token-to-id maps and vocabulary sizes.

    Returns a dict with ``compatible``, ``kind`` ("identical", "padded" or "different"), ``reason``,
    ``target_vocab_size``, ``draft_vocab_size``, ``tokenizer_size``, ``shared_vocab_size`` and ``notes``.
    "padded" pairs share the tokenizer and differ only in embedding rows beyond it; they take the same fast
    path as identical pairs, over the first ``shared_vocab_size`` logits.
    """
    tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    out: dict[str, Any] = {
        "compatible": False, "kind": "different", "reason": None,
        "target_vocab_size": target_rows, "draft_vocab_size": draft_rows,
        "tokenizer_size": None, "shared_vocab_size": None, "notes": [],
    }
    if tv != dv:
        only_t = [t for t in tv if t not in dv]
        only_d = [t for t in dv if t not in tv]
        moved = [t for t in tv if t in dv and tv[t] != dv[t]]
        example = ""
        if moved:
            example = f"; e.g. {moved[0]!r} is id {tv[moved[0]]} in the target and {dv[moved[0]]} in the draft"
        elif only_t or only_d:
            t = (only_t or only_d)[0]
            example = f"; e.g. {t!r} exists only in the {'target' if only_t else 'draft'}"
        out["reason"] = (
            f"different tokenizers: {len(tv):,} target tokens vs {len(dv):,} draft tokens, {len(moved):,} map to "
            f"different ids, {len(only_t):,} only in the target, {len(only_d):,} only in the draft{example}. "
            "Speculative decoding here needs one shared token-to-id map; pick a draft from the target's family."
        )
        return out
    size = max(tv.values()) + 1 if tv else 0
    out["tokenizer_size"] = size
    if min(target_rows, draft_rows) < size:
        who = "target" if target_rows < size else "draft"
        out["reason"] = (f"the {who} has {min(target_rows, draft_rows):,} embedding rows but the tokenizer uses ids "
                         f"up to {size - 1:,}")
        return out
    out["compatible"] = True
    out["shared_vocab_size"] = min(target_rows, draft_rows)
    if target_rows == draft_rows:
        out["kind"] = "identical"
    else:
        out["kind"] = "padded"
        out["notes"].append(
            f"same tokenizer; vocabulary sizes {target_rows:,} vs {draft_rows:,} differ only by padding rows "
            f"beyond the {size:,} tokenizer ids: logits are compared over the first {out['shared_vocab_size']:,}"
        )
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
        a, b = getattr(target_tokenizer, attr, None), getattr(draft_tokenizer, attr, None)
        if a != b:
            out["notes"].append(f"{attr} differs ({a} vs {b}); the target's is used")
    return out


# ----------------------------------------------------------------------------------------------------------
# 3. cost on this hardware


def _prefix_ids(tokenizer, length: int, vocab: int) -> torch.Tensor:
    text = "\n".join(BUILTIN_PROMPTS * 4)
    ids = [i for i in tokenizer(text).input_ids if i < vocab] or list(range(min(vocab, 50)))
    while len(ids) < length:
        ids = ids + ids
    return torch.tensor([ids[:length]])


def measure_costs(target, draft, tokenizer, *, shared_vocab: int, max_k: int = 8, repeats: int = 5,
                  prefix_tokens: int = 100) -> dict:
    """``c`` and ``v(k)`` for k = 0..max_k (see the module docstring), by the one offline probe
    (``hf_specdec.models.measure.measure_costs`` over ``hf_specdec.costmodel.forward_times``: medians)."""
    return costs_over(target, draft, _prefix_ids(tokenizer, prefix_tokens, shared_vocab), max_k=max_k,
                      repeats=repeats)


def costs_over(target, draft, prefix: torch.Tensor, *, max_k: int = 8, repeats: int = 5) -> dict:
    """``measure_costs`` on top of a given cached context (``prefix``: [1, L] token ids): what ``predict``
    reads."""
    prefix_tokens = int(prefix.shape[1])
    costs = probe_costs(target, draft, prefix, range(1, max_k + 2), repeats)
    return {
        "t_step_ms": costs["t_step_s"] * 1e3,
        "t_draft_ms": costs["t_draft_s"] * 1e3,
        "c": costs["c"],
        "verify_cost": {str(k): costs["v"][str(k + 1)] for k in range(max_k + 1)},
        "t_verify_ms": {str(k): costs["t_s"][str(k + 1)] * 1e3 for k in range(max_k + 1)},
        "prefix_tokens": prefix_tokens,
        "repeats": repeats,
    }


# ----------------------------------------------------------------------------------------------------------
# 4. acceptance by teacher forcing


@torch.no_grad()
def measure_acceptance(target, draft, tokenizer, prompts: Sequence[str], *, shared_vocab: int,
                       max_new_tokens: int = 64, max_k: int = 8) -> dict:
    """Greedy target continuation per prompt, then the draft's argmax on the same sequence (teacher forcing).

    ``alpha``: fraction of generated tokens the draft predicts; ``per_position[j-1]``: probability that the
    j-th token of a draft chain is accepted (all j tokens agree); ``per_position_conditional[j-1]``: the same
    given the first j-1 were accepted; ``expected_tokens_measured[k]``: mean tokens per round with k drafts.
    """
    device = next(target.parameters()).device
    draft_device = next(draft.parameters()).device
    runs: list[list[int]] = []
    matches_all: list[bool] = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = vocab_rows(target)
    # padding rows beyond the shared vocabulary are never emitted (as in the decoding loop, which slices logits)
    extra = {"suppress_tokens": list(range(shared_vocab, rows))} if rows > shared_vocab else {}
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
        plen = ids.shape[1]
        seq = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                              min_new_tokens=1, pad_token_id=pad, temperature=None, top_p=None, top_k=None, **extra)
        gen = seq[0, plen:]
        if gen.numel() == 0:
            continue
        logits = draft(seq.to(draft_device)).logits[0, plen - 1:-1, :shared_vocab]
        matches = (logits.argmax(-1).to(gen.device) == gen).tolist()
        matches_all += matches
        runs.append(agreement_runs(matches))  # run length of agreement starting at each generated position
    n = len(matches_all)
    alpha = sum(matches_all) / n if n else 0.0
    per_pos, per_pos_cond, e_meas = [], [], {"0": 1.0}
    for j in range(1, max_k + 1):
        fits = runs_that_fit(runs, j)
        prev = [r[i] for r in runs for i in range(len(r) - j + 1) if r[i] >= j - 1]
        per_pos.append(sum(x >= j for x in fits) / len(fits) if fits else 0.0)
        per_pos_cond.append(sum(x >= j for x in prev) / len(prev) if prev else 0.0)
        e_meas[str(j)] = run_length_tokens(runs, j)
    return {
        "prompts": len(prompts), "tokens": n, "max_new_tokens": max_new_tokens, "alpha": alpha,
        "per_position": per_pos, "per_position_conditional": per_pos_cond, "expected_tokens_measured": e_meas,
    }


def _price(cost: dict) -> RoundCost:
    """The measured costs in target steps as the cost model's price: v(n) by inputs, the draft step c."""
    return RoundCost(ForwardCost.from_table({int(k) + 1: v for k, v in cost["verify_cost"].items()}),
                     t_draft=cost["c"])


def _measured_gains(acceptance: dict, max_k: int) -> list[float]:
    """What draft token k adds to a round, from the measured mean tokens per round with k and k - 1 drafts
    (i.i.d. ``alpha`` where a k was not measured)."""
    iid = prefix_gains([acceptance["alpha"]] * max_k)
    measured = [float(acceptance["expected_tokens_measured"].get(str(k), 1.0 + sum(iid[:k])))
                for k in range(max_k + 1)]
    return [max(0.0, measured[k] - measured[k - 1]) for k in range(1, max_k + 1)]


def predict(cost: dict, acceptance: dict, max_k: int = 8) -> list[dict]:
    """Predicted speedup per k: expected tokens over a round's cost in target steps, k c + v(k + 1) (the cost
    model's ``RoundCost.round``), with i.i.d. acceptance ``alpha`` and with the measured run lengths."""
    price = _price(cost)
    iid, measured = prefix_gains([acceptance["alpha"]] * max_k), _measured_gains(acceptance, max_k)
    rows = []
    for k in range(max_k + 1):
        round_cost = price.round(k, bound=Bound.WORST)
        e, em = expected_tokens(iid[:k]), expected_tokens(measured[:k])
        rows.append({"k": k, "expected_tokens": e, "expected_tokens_measured": em, "round_cost": round_cost,
                     "speedup": e / round_cost, "speedup_measured": em / round_cost})
    return rows


def drafting_row(cost: dict, prediction: list[dict]) -> dict | None:
    """The row of ``predict`` at the k the cost model's one answer picks (``costmodel.best_round`` over the
    measured run lengths, what the adaptive policy decides each round); None where no k > 0 beats a plain step."""
    gains = [r["expected_tokens_measured"] - p["expected_tokens_measured"] for p, r in zip(prediction, prediction[1:])]
    draft = best_round(_price(cost), gains, bound=Bound.WORST)
    return prediction[draft.k] if draft is not None and draft.k > 0 else None


def recommend(cost: dict, prediction: list[dict]) -> dict:
    """Mode, policy and k, by the cost model's one answer (``costmodel.best_round``, what the adaptive policy
    decides each round): speculative when a round that drafts beats a plain step at the measured acceptance;
    otherwise lookahead when a round of draft-free guesses at their prior acceptance (a prompt lookup's, which
    costs no draft step) beats it; else plain decoding."""
    max_k = len(prediction) - 1
    best = max(prediction[1:], key=lambda r: r["speedup_measured"])
    price = _price(cost)
    row = drafting_row(cost, prediction)
    if row is not None:
        return {"mode": "speculative", "policy": "adaptive", "k": row["k"], "predicted_speedup": row["speedup_measured"],
                "why": f"predicted {row['speedup_measured']:.2f}x at k={row['k']} "
                       f"(E={row['expected_tokens_measured']:.2f} tokens/round, round cost "
                       f"{row['round_cost']:.2f} target steps); the adaptive policy starts there and follows "
                       "the acceptance it sees"}
    lookup = prefix_gains([prior_acceptance((SourceKind.HISTORY, 2))] * max_k)
    guesses = best_round(RoundCost(price.cost, t_draft=0.0), lookup, bound=Bound.WORST)
    if guesses is not None and guesses.k > 0:
        return {"mode": "lookahead", "policy": "adaptive", "k": guesses.k, "predicted_speedup": guesses.rate,
                "why": f"this draft does not pay off (best {best['speedup_measured']:.2f}x), but verifying "
                       f"{guesses.k + 1} tokens costs {guesses.seconds:.2f} target steps, so draft-free guesses at "
                       f"a prompt lookup's prior acceptance would give {guesses.rate:.2f}x"}
    v = price(2, Bound.WORST)
    return {"mode": "plain", "policy": None, "k": 0, "predicted_speedup": 1.0,
            "why": f"best predicted speedup {best['speedup_measured']:.2f}x and verifying is not cheap here "
                   f"(v(2)={v:.2f}): plain decoding is fastest"}


# ----------------------------------------------------------------------------------------------------------
# vLLM


def serving_name(ref: str) -> str:
    """The name vLLM should load: a bundle's hub id, else the reference itself."""
    if reference_kind(ref) == "bundle":
        return BUNDLES[ref.removeprefix("bundle:")].hub_id
    return ref


def vllm_config(target_ref: str, draft_ref: str, k: int, draft_quantize: str | None = None) -> dict:
    """The equivalent ``vllm serve`` command with a draft-model speculative config (validated JSON), and the vLLM
    versions it is valid for (``valid_for``, ``note``)."""
    spec: dict[str, Any] = {"method": "draft_model", "model": serving_name(draft_ref),
                            "num_speculative_tokens": max(1, int(k))}
    if draft_quantize in ("4bit", "8bit"):
        spec["quantization"] = "bitsandbytes"
    text = json.dumps(spec)
    if json.loads(text) != spec:  # pragma: no cover - json round trip of plain values
        raise ValueError(f"speculative config does not round-trip through JSON: {text}")
    command = f"vllm serve {shlex.quote(serving_name(target_ref))} --speculative-config {shlex.quote(text)}"
    return {"command": command, "speculative_config": spec, "valid_for": f">={VLLM_MIN_VERSION}", "note": VLLM_NOTE}


# ----------------------------------------------------------------------------------------------------------
# the whole check


def _model_info(ref: str, resolved, rows: int) -> dict:
    return {"ref": ref, "kind": resolved.kind, "path": resolved.path, "vocab_size": rows, "parameters": None,
            "footprint_bytes": None, "dtype": None, "quantize": None, "format": None, "load_time_s": None,
            "choice": None}


def profile_choices(profile: HardwareProfile, workload: Workload, memory_bytes: int | None = None) -> dict:
    """What ``dtype="auto"`` and ``quantize="auto"`` choose from ``profile`` (each a ``Choice.to_dict()`` or None
    where the profile has nothing to choose from), and the workload they are chosen for."""
    target = choose_dtype(profile, workload) if profile.target else None
    draft = (choose_draft_format(profile, memory_bytes=memory_bytes, target_dtype=target.value if target else None)
             if profile.draft else None)
    return {"workload": dataclasses.asdict(workload), "target_dtype": target.to_dict() if target else None,
            "draft_format": draft.to_dict() if draft else None}


def _profile_error(profile: HardwareProfile, cost: dict, target_format: str, draft_format: str) -> dict:
    """The profile's t(1) of the loaded formats against the real models' measured here (relative error)."""
    out: dict[str, float | None] = {"target_step": None, "draft_step": None}
    if target_format in profile.target_formats:
        out["target_step"] = profile.target_entry(target_format).t1 * 1e3 / cost["t_step_ms"] - 1
    if draft_format in profile.draft_formats:
        out["draft_step"] = profile.draft_step(draft_format) * 1e3 / cost["t_draft_ms"] - 1
    return out


def _new_report(device: str, dtype: str) -> dict[str, Any]:
    """A check report with nothing measured yet: the machine, and None for every later answer."""
    return {
        "schema": SCHEMA, "compatible": False, "reason": None,
        "hardware": {**machine_record(device, None if dtype == "auto" else dtype), "cpu_bf16": cpu_has_bf16()},
        "target": None, "draft": None, "tokenizer": None,
        "parameter_ratio": None, "parameter_ratio_guidance": RATIO_GUIDANCE, "profile": None, "choices": None,
        "cost": None, "profile_error": None, "acceptance": None, "prediction": None, "recommendation": None,
        "vllm": None,
    }


def _check_tokenizers(report: dict, target_ref: str, draft_ref: str, *, cache_dir, progress: bool):
    """1. Tokenizers and configs only (no weights): fills the report's ``target``, ``draft``, ``tokenizer`` and
    ``compatible``; returns the resolved references and the target's tokenizer."""
    rt = resolve_reference(target_ref, cache_dir=cache_dir, progress=progress)
    rd = resolve_reference(draft_ref, cache_dir=cache_dir, progress=progress)
    tok_t, tok_d = load_tokenizer(rt), load_tokenizer(rd)
    rows_t, rows_d = vocab_rows(load_config(rt)), vocab_rows(load_config(rd))
    report["target"], report["draft"] = _model_info(target_ref, rt, rows_t), _model_info(draft_ref, rd, rows_d)
    compat = tokenizer_compatibility(tok_t, tok_d, rows_t, rows_d)
    report["tokenizer"] = compat
    report["compatible"], report["reason"] = compat["compatible"], compat["reason"]
    return rt, rd, tok_t


def _load_as_chosen(report: dict, profile: HardwareProfile, target_ref: str, draft_ref: str, *, workload: Workload,
                    dtype: str, draft_quantize: str | None, device: str, cache_dir, progress: bool, log):
    """2. What the profile chooses, then the pair loaded (as chosen or as asked) and sized: fills ``profile``,
    ``choices``, the models' sizes and formats and ``parameter_ratio``; returns the loaded target and draft and
    the draft's ``LoadInfo``."""
    report["profile"] = profile.to_dict()
    report["choices"] = profile_choices(profile, workload, available_memory_bytes(device))
    log("loading target and draft...")
    (target, _, target_load), (draft, _, draft_load) = load_pair(
        target_ref, draft_ref, dtype=dtype, draft_quantize=draft_quantize, device=device, cache_dir=cache_dir,
        progress=progress, profile=profile, workload=workload)
    report["hardware"]["dtype"] = target_load.dtype
    for key, load in (("target_dtype", target_load), ("draft_format", draft_load)):
        if load.choice is not None:  # what loading chose (the draft's, with the memory left after the target)
            report["choices"][key] = load.choice.to_dict()
    for info, model, load in ((report["target"], target, target_load), (report["draft"], draft, draft_load)):
        info.update(parameters=model.num_parameters(), footprint_bytes=footprint_bytes(model), dtype=load.dtype,
                    quantize=load.quantize, format=model_format(model), load_time_s=load.load_time_s,
                    choice=load.choice.to_dict() if load.choice else None)
    report["parameter_ratio"] = report["draft"]["parameters"] / report["target"]["parameters"]
    return target, draft, draft_load


def run_check(target_ref: str, draft_ref: str, *, prompts: Sequence[str] | None = None, max_new_tokens: int = 64,
              draft_quantize: str | None = "auto", dtype: str = "auto", device: str = "cpu", cache_dir=None,
              repeats: int = 5, max_k: int = 8, progress: bool = True, log=None,
              profile: HardwareProfile | None = None, tune: bool = False, workload: Workload | None = None) -> dict:
    """Run the whole check and return the report (the ``--json`` object, schema in docs/models.md).

    ``profile``: use this hardware profile instead of the cached / measured one; ``tune``: measure it again.
    ``dtype`` and ``draft_quantize`` "auto" load the models as the profile chooses for ``workload``.
    """
    log = log or (lambda msg: None)
    device = resolve_device(device)
    workload = workload or Workload()
    prompts = list(prompts) if prompts else list(BUILTIN_PROMPTS)
    report = _new_report(device, dtype)
    # 1. an incompatible pair is refused before any weights load
    rt, rd, tok_t = _check_tokenizers(report, target_ref, draft_ref, cache_dir=cache_dir, progress=progress)
    if not report["compatible"]:
        return report
    # 2. the hardware profile and what it chooses, then load and size
    if profile is None:
        profile = get_profile(rt, rd, device=device, cache_dir=cache_dir, refresh=tune, log=log)
    target, draft, draft_load = _load_as_chosen(report, profile, target_ref, draft_ref, workload=workload,
                                                dtype=dtype, draft_quantize=draft_quantize, device=device,
                                                cache_dir=cache_dir, progress=progress, log=log)
    shared = report["tokenizer"]["shared_vocab_size"]
    # 3. cost, 4. acceptance, prediction
    log(f"measuring c and v(k) for k=0..{max_k} ({repeats} repeats)...")
    report["cost"] = measure_costs(target, draft, tok_t, shared_vocab=shared, max_k=max_k, repeats=repeats)
    report["profile_error"] = _profile_error(profile, report["cost"], report["target"]["format"],
                                             report["draft"]["format"])
    log(f"measuring acceptance on {len(prompts)} prompts ({max_new_tokens} greedy tokens each)...")
    report["acceptance"] = measure_acceptance(target, draft, tok_t, prompts, shared_vocab=shared,
                                              max_new_tokens=max_new_tokens, max_k=max_k)
    report["prediction"] = predict(report["cost"], report["acceptance"], max_k)
    report["recommendation"] = recommend(report["cost"], report["prediction"])
    report["vllm"] = vllm_config(target_ref, draft_ref, report["recommendation"]["k"] or 1, draft_load.quantize)
    return report


def format_choices(choices: dict, loaded: dict | None = None) -> list[str]:
    """Text lines for the profile's choices (and, when given, what was loaded: ``{"target": fmt, "draft": fmt}``)."""
    lines = []
    for key, what, role in (("target_dtype", "target dtype", "target"), ("draft_format", "draft format", "draft")):
        choice = choices.get(key)
        if choice is None:
            continue
        used = (loaded or {}).get(role)
        note = "" if used in (None, choice["value"]) else f" (loaded as {used}, as asked)"
        lines.append(f"{what}{note}: {choice['why']}")  # the why starts with the value chosen
        if choice.get("split"):
            lines.append(f"  split: {choice['split']}")
    w = choices.get("workload")
    if w:
        lines.append(f"  (chosen for a {w['prompt_tokens']}-token prompt, {w['new_tokens']} new tokens, draft "
                     f"acceptance {w['acceptance']:g}; --prompt-tokens / --new-tokens change it)")
    return lines


def format_report(report: dict) -> str:
    """The human-readable form of a check report."""
    gb = lambda b: f"{b / 1e9:.2f} GB" if b is not None else "?"  # noqa: E731
    lines = []
    t, d, tok = report["target"], report["draft"], report["tokenizer"]
    lines.append(f"target  {t['ref']}  ({t['path']})")
    lines.append(f"draft   {d['ref']}  ({d['path']})")
    h = report["hardware"]
    lines.append(f"hardware  {h['device']} ({h['cpu_model']}, {h['torch_threads']} threads, "
                 f"{' '.join(h['cpu_flags']) or 'no avx2/avx512'}), dtype {h['dtype']}, cpu bf16: {h['cpu_bf16']}")
    lines.append("")
    if not report["compatible"]:
        lines.append(f"INCOMPATIBLE: {report['reason']}")
        return "\n".join(lines)
    lines.append(f"tokenizer  compatible ({tok['kind']}), vocab {tok['target_vocab_size']:,} / "
                 f"{tok['draft_vocab_size']:,}, shared {tok['shared_vocab_size']:,}")
    for note in tok["notes"]:
        lines.append(f"  note: {note}")
    ratio = report["parameter_ratio"]
    lines.append(f"parameters  target {t['parameters'] / 1e6:,.0f}M, draft {d['parameters'] / 1e6:,.0f}M: "
                 f"ratio 1/{1 / ratio:.1f} (common guidance ~1/50; the measured cost below is what counts)")
    lines.append(f"memory  target {gb(t['footprint_bytes'])} ({t['dtype']}), draft {gb(d['footprint_bytes'])} "
                 f"({d['quantize'] or d['dtype']})")
    if report.get("profile"):
        lines.append("")
        lines.append(HardwareProfile.from_dict(report["profile"]).describe())
        lines.extend(format_choices(report["choices"], {"target": t.get("format"), "draft": d.get("format")}))
        lines.append("")
    c = report["cost"]
    lines.append(f"cost  target step {c['t_step_ms']:.1f} ms, draft step {c['t_draft_ms']:.1f} ms: c = {c['c']:.3f}")
    err = report.get("profile_error") or {}
    if err.get("target_step") is not None or err.get("draft_step") is not None:
        fmt = lambda x: "n/a" if x is None else f"{x:+.0%}"  # noqa: E731
        lines.append(f"  profile vs these models: target step {fmt(err.get('target_step'))}, draft step "
                     f"{fmt(err.get('draft_step'))}")
    lines.append("verify cost v(k) (k+1 tokens vs 1): " +
                 "  ".join(f"{k}:{v:.2f}" for k, v in c["verify_cost"].items()))
    a = report["acceptance"]
    lines.append(f"acceptance  alpha = {a['alpha']:.3f} over {a['tokens']} tokens from {a['prompts']} prompts; "
                 "per position " + " ".join(f"{p:.2f}" for p in a["per_position"]))
    lines.append("")
    lines.append("  k   E(k) alpha  E(k) measured  round cost  speedup  speedup (measured E)")
    for r in report["prediction"]:
        lines.append(f"  {r['k']:<3d} {r['expected_tokens']:10.2f}  {r['expected_tokens_measured']:13.2f}  "
                     f"{r['round_cost']:10.2f}  {r['speedup']:6.2f}x  {r['speedup_measured']:6.2f}x")
    rec = report["recommendation"]
    lines.append("")
    lines.append(f"recommended: mode={rec['mode']} policy={rec['policy']} k={rec['k']}: {rec['why']}")
    lines.append(f"vLLM: {report['vllm']['command']}")
    lines.append(f"  {report['vllm']['note']}")
    return "\n".join(lines)
