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

5. ``modes`` (per dtype of ``--dtypes``: bf16 and fp16 on CUDA): end-to-end decoding with a draft that agrees with
   the target (the target's layers past the first ``AGREE_LAYERS`` add zero to the residual stream, x + 0 = x in
   every dtype, and the draft is those first layers with the target's embeddings, norm and head, so every greedy
   draft token is kept and the modes differ only in rounds and host work): plain ``generate`` eager and static
   (+ compiled where transformers compiles: CUDA with a static cache, or a ``compile_config``), transformers'
   assisted generation (its defaults; k = 4 constant; static), hf_specdec (``enable(model)`` defaults; fixed k = 4;
   ``cache_implementation="static"`` with the same ``compile_config``). Per mode: tok/s, rounds, time in the
   target's and draft's forwards (module hooks), host ms per round (the rest over the verify forwards), and
   whether the output is token-identical to plain eager greedy (bf16/fp16 verification over several tokens may
   flip an exact near-tie: reported, not asserted). Modes run in a balanced order (``eval/interleave.py``).

Random weights make random text; what is measured is cost, not quality. The bundled GGUF pair cannot travel to a
lent machine (no hub, and the copy carried there is 64 MiB at most), so the Qwen2.5-Coder shapes stand in for it.
The whole run is sized for about 6 minutes on an H100 (``--skip`` drops sections; ``--dtypes bf16`` halves
``modes``); a few seconds with ``--tiny``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # eval/, when run as bench/gpu_check.py

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


# -- 5. end-to-end modes with an agreeing draft ---------------------------------------------------------------------
AGREE_LAYERS = 2  # the draft's layers: the target's first ones; the target's others add zero
MODES = ("plain", "plain_static", "hf_default", "hf_k4", "hf_static", "specdec_default", "specdec_k4",
         "specdec_static")


def agreeing_pair(target_dict: dict, dtype: str, device: str):
    """(target, draft): a random target whose layers past the first ``AGREE_LAYERS`` add zero to the residual
    stream (their output projections are zero), and a draft holding its first layers, embeddings, norm and head."""
    target, config = build(target_dict, dtype, device)
    with torch.no_grad():
        for layer in target.model.layers[AGREE_LAYERS:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:AGREE_LAYERS]
    draft.config.num_hidden_layers = AGREE_LAYERS
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:AGREE_LAYERS]
    return target.eval(), draft.eval(), config


class ForwardClock:
    """Seconds inside the forwards of the given modules (pre/post hooks; on CUDA each hook synchronises, so the
    clock reads the kernels' time, not their launch), and how many calls."""

    def __init__(self, modules, device: torch.device):
        self.device, self.seconds, self.calls, self._start = device, 0.0, 0, 0.0
        self.handles = [h for m in modules for h in (m.register_forward_pre_hook(self._pre),
                                                       m.register_forward_hook(self._post))]

    def _pre(self, module, args):
        sync(self.device)
        self._start = time.perf_counter()

    def _post(self, module, args, output):
        sync(self.device)
        self.seconds += time.perf_counter() - self._start
        self.calls += 1

    def reset(self):
        self.seconds, self.calls = 0.0, 0

    def close(self):
        for handle in self.handles:
            handle.remove()


def compile_config(device: torch.device, tiny: bool):
    """transformers' ``CompileConfig`` for the static modes: its defaults on CUDA (inductor, CUDA graphs); on a
    CPU smoke run the eager backend, asked for on every device (``_compile_all_devices``), so the path runs in
    seconds."""
    from transformers import CompileConfig

    if device.type == "cuda" and not tiny:
        return CompileConfig()
    config = CompileConfig(backend="eager", mode=None) if tiny else CompileConfig(mode=None)
    config._compile_all_devices = True  # noqa: SLF001 - transformers' own switch for compiling off CUDA
    return config


def run_mode(mode: str, target, draft, ids, new_tokens: int, compiled):
    """One greedy call of ``mode``: (sequences, hf_specdec's stats or None)."""
    from transformers import GenerationConfig

    kwargs = generate_kwargs(ids, new_tokens)
    static = dict(cache_implementation="static", compile_config=compiled)
    gc, default = draft.generation_config, GenerationConfig()
    knobs = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    for name in knobs:  # transformers' defaults unless the mode sets k = 4
        setattr(gc, name, getattr(default, name))
    if mode in ("hf_k4", "specdec_k4"):
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = \
            4, "constant", 0.0
    own = type(target).generate  # transformers' own, past enable()
    if mode == "plain":
        return own(target, **kwargs), None
    if mode == "plain_static":
        return own(target, **kwargs, **static), None
    if mode in ("hf_default", "hf_k4"):
        return own(target, **kwargs, assistant_model=draft), None
    if mode == "hf_static":
        return own(target, **kwargs, assistant_model=draft, **static), None
    spec = {"policy": "fixed", "num_draft_tokens": 4} if mode == "specdec_k4" else None
    extra = static if mode == "specdec_static" else {}
    out = target.generate(**kwargs, assistant_model=draft, spec_config=spec, **extra)
    return out, target.last_spec_stats


def measure_modes(target_dict: dict, dtype: str, device: str, new_tokens: int, runs: int, tiny: bool) -> dict:
    """Section 5 for one dtype (module docstring)."""
    import hf_specdec
    from eval.interleave import order as run_order

    dev = torch.device(device)
    target, draft, config = agreeing_pair(target_dict, dtype, device)
    hf_specdec.enable(target)
    compiled = compile_config(dev, tiny)
    clocks = {"target": ForwardClock([target.model, target.lm_head], dev),
              "draft": ForwardClock([draft.model, draft.lm_head], dev)}
    prompts = [prompt_ids(config.vocab_size, 32 + 7 * i, device) for i in range(runs)]
    totals = {m: dict(tokens=0, seconds=0.0, target_s=0.0, draft_s=0.0, verify_forwards=0, identical=0,
                      failed=None) for m in MODES}
    with torch.inference_mode():
        for mode in MODES:  # a warm-up call each (compiles what the mode compiles)
            try:
                _, seconds = timed(lambda: run_mode(mode, target, draft, prompts[0], new_tokens, compiled), dev)
                totals[mode]["warmup_s"] = seconds
            except Exception as error:  # noqa: BLE001 - a mode that cannot run here is reported, the others go on
                totals[mode]["failed"] = f"{type(error).__name__}: {error}"[:300]
                log(f"{dtype} {mode}: failed: {totals[mode]['failed']}")
        live = [m for m in MODES if totals[m]["failed"] is None]
        for index, ids in enumerate(prompts):
            reference = type(target).generate(target, **generate_kwargs(ids, new_tokens))
            for mode in run_order(live, index):
                for clock in clocks.values():
                    clock.reset()
                (out, _), seconds = timed(lambda: run_mode(mode, target, draft, ids, new_tokens, compiled), dev)
                row = totals[mode]
                row["tokens"] += out.shape[1] - ids.shape[1]
                row["seconds"] += seconds
                row["target_s"] += clocks["target"].seconds
                row["draft_s"] += clocks["draft"].seconds
                row["verify_forwards"] += max(0, clocks["target"].calls // 2 - 1)  # decoder + head; less the prefill
                row["identical"] += int(torch.equal(out.to(reference.device), reference))
    for clock in clocks.values():
        clock.close()
    for mode in live:
        row = totals[mode]
        row["tok_s"] = row["tokens"] / row["seconds"]
        row["host_s"] = row["seconds"] - row["target_s"] - row["draft_s"]
        row["host_ms_per_round"] = 1e3 * row["host_s"] / max(1, row["verify_forwards"])
        log(f"{dtype} {mode}: {row['tok_s']:.1f} tok/s, host {row['host_ms_per_round']:.2f} ms/round, "
            f"identical {row['identical']}/{runs}")
    ratios = {}

    def ratio(a: str, b: str, key: str = "tok_s"):
        if a in live and b in live and totals[b][key]:
            ratios[f"{key}_{a}_over_{b}"] = totals[a][key] / totals[b][key]

    ratio("specdec_k4", "hf_k4", "host_s")
    ratio("specdec_k4", "hf_k4")
    ratio("specdec_default", "hf_default")
    ratio("specdec_default", "plain")
    ratio("specdec_static", "plain_static")
    ratio("specdec_static", "hf_static")
    del target, draft
    return {"dtype": dtype, "agree_layers": AGREE_LAYERS, "runs": runs, "new_tokens": new_tokens,
            "compile_config": compiled.to_dict(), "modes": totals, "ratios": ratios}


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
    parser.add_argument("--skip", default="",
                        help="comma-separated sections to skip: profile,overhead,scripted,modes")
    parser.add_argument("--dtypes", default=None,
                        help="dtypes of the t(n) and modes sections (default: bf16,fp16 on CUDA; --dtype on CPU)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available (use --device cpu --tiny for the smoke test)")
    dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    dtypes = (args.dtypes.split(",") if args.dtypes
              else ["bf16", "fp16"] if args.device.startswith("cuda") and not args.dtype else [dtype])
    new_tokens = args.new_tokens or (24 if args.tiny else 128)
    runs = args.runs or (1 if args.tiny else 3)
    repeats = 2 if args.tiny else 10
    skip = {s for s in args.skip.split(",") if s}
    target_dict, draft_dict = (TINY_TARGET, TINY_DRAFT) if args.tiny else (QWEN_1_5B, QWEN_0_5B)
    started = time.perf_counter()
    torch.manual_seed(0)
    report: dict = {"schema": "hf_specdec.gpu_check/2", "environment": environment(args.device), "dtype": dtype,
                    "tiny": args.tiny, "configs": {"target": target_dict, "draft": draft_dict}}
    log(f"building random {'tiny' if args.tiny else 'Qwen2.5-Coder 1.5B / 0.5B'} models in {dtype} on {args.device}")
    target, target_config = build(target_dict, dtype, args.device)
    draft, draft_config = build(draft_dict, dtype, args.device)
    vocab = target_config.vocab_size
    report["t_n"] = t_n = measure_t_n(target, draft, vocab, repeats)
    log(f"t(1) {t_n['t_ms']['1']:.2f} ms, v(8) {t_n['v']['8']:.2f}, v(32) {t_n['v']['32']:.2f}, c {t_n['c']:.3f}")
    del draft
    others = [d for d in dtypes if d != dtype]
    report["t_n_by_dtype"] = {dtype: t_n}
    for other in others:  # t(n) in each other dtype asked for, on models built in it
        other_target, _ = build(target_dict, other, args.device)
        other_draft, _ = build(draft_dict, other, args.device)
        report["t_n_by_dtype"][other] = measure_t_n(other_target, other_draft, vocab, repeats)
        del other_target, other_draft
    if "profile" not in skip:
        formats = ("bf16", "fp16") if args.device.startswith("cuda") else ("bf16", "fp32")
        report["profile"] = measure_profile(target, target_config, draft_config, t_n, args.device, formats)
    if "overhead" not in skip:
        report["overhead"] = measure_overhead(target, t_n, vocab, (1, 4, 8) if not args.tiny else (2, 4),
                                              new_tokens, runs)
    if "scripted" not in skip:
        report["scripted"] = measure_scripted(target, vocab, (0, 1, 2, 4, 8) if not args.tiny else (0, 2, 4),
                                              8 if not args.tiny else 4, new_tokens, runs)
    if "modes" not in skip:
        del target
        report["modes"] = [measure_modes(target_dict, d, args.device, new_tokens, runs + 1, args.tiny) for d in dtypes]
    report["seconds"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=1))
    log(f"wrote {args.out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
