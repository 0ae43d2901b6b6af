"""GPU readiness check: what hf_specdec's costs and overheads are on a CUDA device, with no weights shipped.

    python bench/gpu_check.py --out gpu_check.json                 # a CUDA machine: Qwen2.5-Coder shapes, bf16
    python bench/gpu_check.py --device cpu --tiny --out smoke.json  # seconds, anywhere: the smoke test

Random-weight models of the real Qwen2.5-Coder-1.5B / 0.5B shapes are built on the device from the configs below
(``hf_specdec.models.build_proxy`` with every layer). Measured, in order, all written to one JSON file:

1. ``t_n``: the target's t(n), one forward over n new tokens on a cached 100-token prefix
   (``hf_specdec.costmodel.forward_times``), n = 1..32, and v(n) = t(n) / t(1); the draft's t(1) and c.
2. ``profile``: the hardware profile's proxies (1 and 2 layers, scaled) against these full-size models: the
   relative error of the proxy per n, then what ``choose_dtype`` / ``choose_draft_format`` pick from the proxies.
3. ``overhead``: per-round time of hf_specdec speculative decoding (policy "fixed", k draft tokens) against
   transformers' assisted loop (``assistant_model=``, fixed k), both with a draft that is an exact copy of the
   target (every greedy draft token is accepted, so both run the same rounds); per-round overhead = time per
   round minus the forwards it needs (k draft steps + one verify over k + 1 tokens, from ``t_n``).
4. ``scripted``: a drafter with set acceptance (the plain greedy continuation, corrupted after ``right`` tokens;
   the batch Drafter protocol of ``hf_specdec/drafters/base.py``; its drafting costs nothing), policies fixed and
   adaptive: tokens/s against plain decoding, rounds, and whether the output is identical to plain greedy (bf16
   verification over several tokens may flip an exact near-tie; the count is reported, not asserted).

Random weights make random text; what is measured is cost, not quality. The whole run takes about a minute on
an H200 (a few seconds with ``--tiny``).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

QWEN_1_5B = {  # Qwen/Qwen2.5-Coder-1.5B-Instruct config.json (architecture fields)
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 1536,
    "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "max_window_layers": 28, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": True, "vocab_size": 151936,
    "bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643,
}
QWEN_0_5B = {  # Qwen/Qwen2.5-Coder-0.5B-Instruct config.json (architecture fields)
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "max_window_layers": 24, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": True, "vocab_size": 151936,
    "bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643,
}
TINY_TARGET = {**QWEN_1_5B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_window_layers": 4, "vocab_size": 512,
               "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
TINY_DRAFT = {**TINY_TARGET, "num_hidden_layers": 2, "max_window_layers": 2}
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
PREFIX = 100


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(config_dict: dict, dtype: str, device: str):
    """A random-weight model of this config on ``device`` (every layer; no weights loaded)."""
    from transformers import AutoConfig

    from hf_specdec.models import build_proxy

    data = {k: v for k, v in config_dict.items() if k != "architectures"}
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    model = build_proxy(config, dtype, device, layers=config.num_hidden_layers)
    for name in ("eos_token_id", "bos_token_id"):  # random text: no early stop, every run emits max_new_tokens
        setattr(model.generation_config, name, None)
    model.generation_config.pad_token_id = config.pad_token_id
    return model, config


def prompt_ids(vocab: int, length: int, device) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (1, length), generator=generator).to(device)


def timed(fn, device: torch.device):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def generate_kwargs(ids: torch.LongTensor, new_tokens: int) -> dict:
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


# -- 1. t(n) --------------------------------------------------------------------------------------------------------
def measure_t_n(target, draft, vocab: int, repeats: int) -> dict:
    from hf_specdec.costmodel import forward_times

    device = next(target.parameters()).device
    prefix = prompt_ids(vocab, PREFIX, device)
    t = forward_times(target, prefix, SIZES, repeats)
    t_draft = forward_times(draft, prefix, [1], repeats)[1]
    return {"context_tokens": PREFIX, "repeats": repeats, "t_ms": {str(n): s * 1e3 for n, s in t.items()},
            "v": {str(n): s / t[1] for n, s in t.items()}, "t_draft_ms": t_draft * 1e3, "c": t_draft / t[1]}


# -- 2. the profile's proxies against the full models ----------------------------------------------------------------
def measure_profile(target, target_config, draft_config, t_n: dict, device: str, formats: tuple[str, ...]) -> dict:
    from hf_specdec import models as P

    out: dict = {"target": {}, "draft": {}, "notes": []}
    entries = []
    for fmt in formats:
        try:
            entries.append(P.measure_format(target_config, "target", fmt, device, prefill_tokens=256))
        except P.FormatUnavailable as err:
            out["notes"].append(f"target {fmt}: {err}")
    drafts = []
    for fmt in P.candidate_formats("draft", device):
        try:
            drafts.append(P.measure_format(draft_config, "draft", fmt, device))
        except P.FormatUnavailable as err:
            out["notes"].append(f"draft {fmt}: {err}")
    profile = P.HardwareProfile(P.DeviceIdentity.here(device), torch.__version__, tuple(entries), tuple(drafts))
    out["profile"] = profile.to_dict()
    real_format = P.model_format(target)
    if real_format in profile.target_formats:
        proxy = profile.target_entry(real_format).table
        out["proxy_error"] = {str(n): proxy[n] / (t_n["t_ms"][str(n)] / 1e3) - 1 for n in proxy}
    if entries:
        out["target"] = P.choose_dtype(profile).to_dict()
    if drafts:
        out["draft"] = P.choose_draft_format(profile, target_dtype=out["target"].get("value")).to_dict()
    return out


# -- 3. per-round overhead: hf_specdec vs transformers' assisted loop -----------------------------------------------
class ForwardCount:
    def __init__(self, module):
        self.count = 0
        self.handle = module.register_forward_pre_hook(self.hook)

    def hook(self, module, args):
        self.count += 1

    def close(self):
        self.handle.remove()


def measure_overhead(target, t_n: dict, vocab: int, ks: tuple[int, ...], new_tokens: int, runs: int) -> list[dict]:
    import hf_specdec

    device = next(target.parameters()).device
    draft = copy.deepcopy(target)  # an exact copy: every greedy draft token is accepted
    ids = prompt_ids(vocab, 32, device)
    kwargs = generate_kwargs(ids, new_tokens)
    rows = []
    for k in ks:
        config = hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=k, max_draft_tokens=max(k, 12))
        gc = draft.generation_config
        saved = (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold)
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = \
            k, "constant", 0.0
        try:
            samples: dict[str, list[tuple[float, int]]] = {"hf_specdec": [], "transformers": []}
            for run in range(runs + 1):  # the first is a warm-up
                for name in samples:
                    counter = ForwardCount(target)
                    with torch.inference_mode():
                        if name == "hf_specdec":
                            out, seconds = timed(lambda: target.generate(
                                **kwargs, custom_generate=hf_specdec.speculative_generate, draft_model=draft,
                                spec_config=config, return_dict_in_generate=True), device)
                            verify_forwards = out.spec_stats.rounds
                        else:
                            _, seconds = timed(lambda: type(target).generate(target, **kwargs,
                                                                              assistant_model=draft), device)
                            verify_forwards = counter.count
                    counter.close()
                    if run:
                        samples[name].append((seconds, verify_forwards))
        finally:
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = saved
        forwards_ms = k * t_n["t_ms"]["1"] + _interpolate(t_n["t_ms"], k + 1)
        row = {"k": k, "new_tokens": new_tokens, "forwards_per_round_ms": forwards_ms}
        for name, values in samples.items():
            seconds = statistics.median(s for s, _ in values)
            rounds = values[-1][1]
            per_round = seconds / max(rounds, 1) * 1e3
            row[name] = {"seconds": seconds, "rounds": rounds, "per_round_ms": per_round,
                         "overhead_per_round_ms": per_round - forwards_ms}
        row["hf_specdec_over_transformers"] = row["hf_specdec"]["per_round_ms"] / row["transformers"]["per_round_ms"]
        rows.append(row)
        log(f"k={k}: hf_specdec {row['hf_specdec']['per_round_ms']:.1f} ms/round, transformers "
            f"{row['transformers']['per_round_ms']:.1f} ms/round, forwards alone {forwards_ms:.1f} ms")
    del draft
    return rows


def _interpolate(table_ms: dict, n: int) -> float:
    sizes = sorted(int(s) for s in table_ms)
    if n in sizes:
        return table_ms[str(n)]
    low = max(s for s in sizes if s <= n)
    high = min((s for s in sizes if s >= n), default=low)
    if high == low:
        return table_ms[str(low)]
    return table_ms[str(low)] + (table_ms[str(high)] - table_ms[str(low)]) * (n - low) / (high - low)


# -- 4. a scripted drafter with set acceptance ----------------------------------------------------------------------
class ScriptedDrafter:
    """Proposes the plain greedy continuation, right for ``right`` tokens of each proposal and wrong after (the
    batch Drafter protocol of ``hf_specdec/drafters/base.py``; one row; it holds no cache)."""

    def __init__(self, reference: torch.LongTensor, right: int, vocab: int):
        self.reference, self.right, self.vocab = reference[0].cpu(), right, vocab

    def prefill(self, views):
        pass

    def offer(self, views):
        from hf_specdec.round import Offer

        return [Offer(model_tokens=view.budget) for view in views]

    def propose(self, views, plans):
        from hf_specdec.round import Proposal, Source, SourceKind

        proposals = []
        for view, plan in zip(views, plans):
            start = time.perf_counter()
            begin = view.ids.shape[0]
            tokens = self.reference[begin: begin + plan.model_tokens].clone()
            tokens[self.right:] = (tokens[self.right:] + 1) % self.vocab  # wrong from position right + 1 on
            n = tokens.shape[0]
            proposals.append(Proposal.chain(tokens.tolist(), [Source(SourceKind.DRAFT, 0, i) for i in range(1, n + 1)],
                                            confidences=(0.9,) * n, draft_time=time.perf_counter() - start))
        return proposals

    def update(self, outcomes):
        pass

    def cache_bytes(self):
        return 0

    def release(self):
        pass


def measure_scripted(target, vocab: int, rights: tuple[int, ...], k: int, new_tokens: int, runs: int) -> list[dict]:
    import hf_specdec

    device = next(target.parameters()).device
    ids = prompt_ids(vocab, 32, device)
    kwargs = generate_kwargs(ids, new_tokens)
    with torch.inference_mode():
        reference, _ = timed(lambda: type(target).generate(target, **{**kwargs, "max_new_tokens": new_tokens + k + 1,
                                                                       "min_new_tokens": new_tokens + k + 1}), device)
        plain_s = []
        for run in range(runs + 1):
            out, seconds = timed(lambda: type(target).generate(target, **kwargs), device)
            if run:
                plain_s.append(seconds)
    plain = statistics.median(plain_s)
    expected = reference[:, : ids.shape[1] + new_tokens]
    rows = [{"mode": "plain", "seconds": plain, "tokens_per_s": new_tokens / plain}]
    for policy in ("fixed", "adaptive"):
        config = hf_specdec.SpecConfig(policy=policy, num_draft_tokens=k, max_draft_tokens=max(k, 12))
        for right in rights:
            samples, identical = [], True
            for run in range(runs + 1):
                drafter = ScriptedDrafter(reference, right, vocab)
                with torch.inference_mode():
                    out, seconds = timed(lambda: target.generate(
                        **kwargs, custom_generate=hf_specdec.speculative_generate, draft_model=drafter,
                        spec_config=config, return_dict_in_generate=True), device)
                identical &= bool(torch.equal(out.sequences, expected))
                if run:
                    samples.append(seconds)
            stats = out.spec_stats
            seconds = statistics.median(samples)
            rows.append({"mode": f"scripted_{policy}", "right": right, "k": k, "seconds": seconds,
                         "tokens_per_s": new_tokens / seconds, "speedup_vs_plain": plain / seconds,
                         "rounds": stats.rounds, "rounds_spec_off": stats.rounds_spec_off,
                         "mean_accepted_length": stats.mean_accepted_length, "identical_to_plain": identical})
            log(f"scripted {policy} right={right}: {plain / seconds:.2f}x plain, {stats.rounds} rounds, "
                f"identical={identical}")
    return rows


# -- main -----------------------------------------------------------------------------------------------------------
def environment(device: str) -> dict:
    import transformers

    import hf_specdec

    env = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
           "hf_specdec": hf_specdec.__version__, "python": platform.python_version(), "platform": platform.platform(),
           "torch_threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        env.update(gpu=torch.cuda.get_device_name(index), cuda=torch.version.cuda,
                   capability=".".join(map(str, torch.cuda.get_device_capability(index))),
                   memory_gb=torch.cuda.get_device_properties(index).total_memory / 1e9)
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json", help="JSON output path (default gpu_check.json)")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny configs (a smoke test, seconds on a CPU)")
    parser.add_argument("--dtype", default=None, help="bf16 (default on CUDA) or fp32 (default on CPU)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per generation (default 128, tiny 24)")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per mode, median (default 3, tiny 1)")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: profile,overhead,scripted")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available (use --device cpu --tiny for the smoke test)")
    dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    new_tokens = args.new_tokens or (24 if args.tiny else 128)
    runs = args.runs or (1 if args.tiny else 3)
    repeats = 2 if args.tiny else 10
    skip = {s for s in args.skip.split(",") if s}
    target_dict, draft_dict = (TINY_TARGET, TINY_DRAFT) if args.tiny else (QWEN_1_5B, QWEN_0_5B)
    started = time.perf_counter()
    torch.manual_seed(0)
    report: dict = {"schema": "hf_specdec.gpu_check/1", "environment": environment(args.device), "dtype": dtype,
                    "tiny": args.tiny, "configs": {"target": target_dict, "draft": draft_dict}}
    log(f"building random {'tiny' if args.tiny else 'Qwen2.5-Coder 1.5B / 0.5B'} models in {dtype} on {args.device}")
    target, target_config = build(target_dict, dtype, args.device)
    draft, draft_config = build(draft_dict, dtype, args.device)
    vocab = target_config.vocab_size
    report["t_n"] = t_n = measure_t_n(target, draft, vocab, repeats)
    log(f"t(1) {t_n['t_ms']['1']:.2f} ms, v(8) {t_n['v']['8']:.2f}, v(32) {t_n['v']['32']:.2f}, c {t_n['c']:.3f}")
    del draft
    if "profile" not in skip:
        formats = ("bf16", "fp16") if args.device.startswith("cuda") else ("bf16", "fp32")
        report["profile"] = measure_profile(target, target_config, draft_config, t_n, args.device, formats)
    if "overhead" not in skip:
        report["overhead"] = measure_overhead(target, t_n, vocab, (1, 4, 8) if not args.tiny else (2, 4),
                                              new_tokens, runs)
    if "scripted" not in skip:
        report["scripted"] = measure_scripted(target, vocab, (0, 1, 2, 4, 8) if not args.tiny else (0, 2, 4),
                                              8 if not args.tiny else 4, new_tokens, runs)
    report["seconds"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=1))
    log(f"wrote {args.out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
