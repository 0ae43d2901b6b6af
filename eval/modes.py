"""Decoding modes, one timed generation per call, and the model probes the metrics need.

Modes
-----
- ``plain``: transformers ``generate`` (greedy or sampling), no speculation: the baseline.
- ``hf_assisted``: transformers assisted generation with ``assistant_model=draft`` and transformers' defaults
  (num_assistant_tokens=20, "constant", confidence stop 0.4 with ROC re-tuning).
- ``hf_assisted_k3`` / ``hf_assisted_k5``: transformers assisted generation with a fixed k. The draft's
  generation_config gets ``num_assistant_tokens=k``, ``num_assistant_tokens_schedule="constant"`` and
  ``assistant_confidence_threshold=0`` (off, else k is not fixed), restored afterwards (transformers ignores
  kwargs to ``generate`` for these).
- ``hf_prompt_lookup``: transformers prompt lookup, ``prompt_lookup_num_tokens=10`` (max_matching_ngram_size 2).
- ``specdec_adaptive``: hf_specdec, ``SpecConfig(policy="adaptive")``.
- ``specdec_fixed``: hf_specdec, ``SpecConfig(policy="fixed", num_draft_tokens=--spec-k)``.
- ``specdec_heuristic``: hf_specdec, ``SpecConfig(policy="heuristic", num_draft_tokens=--spec-k)`` (+2/-1 rule).
- ``lookahead``: hf_specdec lookahead decoding, ``LookaheadConfig()`` (auto W, N, G), no draft model; cold
  (``lookahead_memory=None``: no call learns from an earlier one).

transformers' own modes always run on the unmodified transformers ``generate``: they call
``type(model).generate(model, ...)``, which skips the per-instance override that ``hf_specdec.enable`` installs.
"""

from __future__ import annotations

import copy
import gc
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

HF_MODES = ("plain", "hf_assisted", "hf_assisted_k3", "hf_assisted_k5", "hf_prompt_lookup")
SPECDEC_MODES = ("specdec_adaptive", "specdec_fixed", "specdec_heuristic")
ALL_MODES = HF_MODES + SPECDEC_MODES + ("lookahead",)
DRAFT_MODES = ("hf_assisted", "hf_assisted_k3", "hf_assisted_k5") + SPECDEC_MODES


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; known: {list(ALL_MODES)}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"duplicate modes in {text!r}")
    if "plain" not in modes:
        modes.insert(0, "plain")  # the baseline every speedup and parity check is measured against
    return modes


class TimingStreamer:
    """Records time to first token: the first ``put`` is the prompt, the second carries the first new token(s).

    Also records hf_specdec's per-round ``on_round(num_accepted_draft_tokens, num_emitted)`` callbacks.
    """

    def __init__(self, sync):
        self._sync = sync
        self.puts = 0
        self.t_first: float | None = None
        self.streamed_tokens = 0
        self.rounds: list[tuple[int, int]] = []

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 1:
            return  # the prompt
        if self.t_first is None:
            self._sync()
            self.t_first = time.perf_counter()
        self.streamed_tokens += int(value.numel())

    def on_round(self, num_accepted_draft_tokens: int, num_emitted: int) -> None:
        self.rounds.append((int(num_accepted_draft_tokens), int(num_emitted)))

    def end(self) -> None:
        pass


def _device_of(model) -> torch.device:
    try:
        return model.device
    except AttributeError:
        return next(model.parameters()).device


def _rss_reset() -> bool:
    try:  # Linux: writing 5 resets the peak RSS (VmHWM) of this process
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _rss_peak() -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class Settings:
    max_new_tokens: int = 128
    temperature: float = 0.0
    spec_k: int = 4
    lookahead: dict | None = None  # LookaheadConfig kwargs


class Generator:
    """Runs one generation of one mode on one prompt and returns its measurements (a row without keys)."""

    def __init__(self, target, tokenizer, draft=None, settings: Settings | None = None):
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        self.settings = settings or Settings()
        self.device = _device_of(target)
        self.cuda = self.device.type == "cuda"
        self._forwards = 0
        self._hook = target.register_forward_pre_hook(self._count)
        self._specdec = None

    def _count(self, module, args) -> None:
        self._forwards += 1

    def close(self) -> None:
        self._hook.remove()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @property
    def specdec(self):
        if self._specdec is None:
            import hf_specdec

            hf_specdec.enable(self.target)
            self._specdec = hf_specdec
        return self._specdec

    def encode(self, text: str, chat: bool = False) -> torch.Tensor:
        """Token ids of the model input. A chat-template rendering already holds its special tokens; a raw
        (completion-style) prompt gets the tokenizer's usual ones (e.g. BOS), as a user's own call would."""
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=not chat)["input_ids"]
        return ids.to(self.device)

    def _common(self, input_ids, streamer, max_new_tokens) -> dict[str, Any]:
        s = self.settings
        kwargs: dict[str, Any] = dict(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            streamer=streamer,
            pad_token_id=self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.tokenizer.eos_token_id,
        )
        if s.temperature > 0:
            # the same plain distribution for every mode: no top-k/top-p/repetition penalty from generation_config
            kwargs.update(do_sample=True, temperature=s.temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False)
        return kwargs

    def _call(self, mode: str, kwargs: dict[str, Any]):
        model = self.target
        hf_generate = type(model).generate  # the unmodified transformers generate
        if mode == "plain":
            return hf_generate(model, **kwargs)
        if mode == "hf_prompt_lookup":
            return hf_generate(model, **kwargs, prompt_lookup_num_tokens=10)
        if mode in ("hf_assisted", "hf_assisted_k3", "hf_assisted_k5"):
            self._need_draft(mode)
            cfg = self.draft.generation_config
            saved = {k: getattr(cfg, k, None) for k in
                     ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
            try:
                if mode != "hf_assisted":
                    cfg.num_assistant_tokens = int(mode.rsplit("_k", 1)[1])
                    cfg.num_assistant_tokens_schedule = "constant"
                    cfg.assistant_confidence_threshold = 0.0
                return hf_generate(model, **kwargs, assistant_model=self.draft)
            finally:
                for k, v in saved.items():
                    setattr(cfg, k, v)
        sd = self.specdec
        if mode in SPECDEC_MODES:
            self._need_draft(mode)
            policy = mode.split("_", 1)[1]
            spec_config = sd.SpecConfig(policy=policy, num_draft_tokens=self.settings.spec_k,
                                        max_draft_tokens=max(12, self.settings.spec_k))
            return model.generate(**kwargs, assistant_model=self.draft, spec_config=spec_config)
        if mode == "lookahead":
            la = sd.LookaheadConfig(**(self.settings.lookahead or {}))
            # cold: each call on its own (with enable()'s shared LookaheadMemory a repeat would copy itself)
            return model.generate(**kwargs, decoding="lookahead", lookahead_config=la, lookahead_memory=None)
        raise ValueError(f"unknown mode {mode!r}")

    def _need_draft(self, mode: str) -> None:
        if self.draft is None:
            raise ValueError(f"mode {mode} needs a draft model (--draft)")

    def generate(self, mode: str, text: str, seed: int, max_new_tokens: int | None = None,
                 chat: bool = False) -> dict[str, Any]:
        max_new_tokens = max_new_tokens or self.settings.max_new_tokens
        input_ids = self.encode(text, chat)
        streamer = TimingStreamer(self.sync)
        kwargs = self._common(input_ids, streamer, max_new_tokens)
        saved_gc = copy.deepcopy(self.target.generation_config)
        saved_draft_gc = copy.deepcopy(self.draft.generation_config) if self.draft is not None else None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        rss_ok = not self.cuda and _rss_reset()
        torch.manual_seed(seed)
        if self.cuda:
            torch.cuda.manual_seed_all(seed)
        self._forwards = 0
        if hasattr(self.target, "last_spec_stats"):
            try:
                self.target.last_spec_stats = None
            except AttributeError:
                pass
        gc.collect()  # no collection of earlier garbage inside the timed window
        self.sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self._call(mode, kwargs)
        self.sync()
        end = time.perf_counter()
        self.target.generation_config = saved_gc
        if saved_draft_gc is not None:
            self.draft.generation_config = saved_draft_gc
        forwards = self._forwards
        sequences = out.sequences if hasattr(out, "sequences") else out
        new_ids = sequences[0, input_ids.shape[1]:].tolist()
        n = len(new_ids)
        e2e = end - start
        ttft = (streamer.t_first - start) if streamer.t_first is not None else None
        row: dict[str, Any] = {
            "prompt_tokens": int(input_ids.shape[1]),
            "new_tokens": n,
            "output_ids": new_ids,
            "text": self.tokenizer.decode(new_ids, skip_special_tokens=True),
            "e2e_s": e2e,
            "ttft_s": ttft,
            "tpot_s": (e2e - ttft) / (n - 1) if ttft is not None and n > 1 else None,
            "tokens_per_s": n / e2e if e2e > 0 else None,
            "target_forwards": forwards,
            "streamed_tokens": streamer.streamed_tokens,
        }
        if self.cuda:
            row.update(peak_mem_bytes=int(torch.cuda.max_memory_allocated(self.device)), mem_kind="cuda_max_allocated")
        else:
            row.update(peak_mem_bytes=_rss_peak(), mem_kind="rss_peak" if rss_ok else "rss_peak_process")
        stats = getattr(self.target, "last_spec_stats", None) if mode not in HF_MODES else None
        if stats is not None:
            row["spec"] = stats.to_dict() if hasattr(stats, "to_dict") else dict(stats)
            rounds = row["spec"].get("rounds")
            row["mean_accepted_length"] = row["spec"].get("mean_accepted_length") or (n / rounds if rounds else None)
        else:
            row["spec"] = None
            # tokens per target forward (prefill included), the same definition as SpecStats.mean_accepted_length
            row["mean_accepted_length"] = n / forwards if forwards else None
        if streamer.rounds:
            row["round_log"] = streamer.rounds
        return row


# --- probes: teacher forcing and forward costs ---------------------------------------------------------------


@torch.inference_mode()
def teacher_forced(model, prompt_ids: list[int], gen_ids: list[int]) -> dict[str, list]:
    """One forward over prompt + generated tokens: per generated position, the model's argmax and top1-top2 margin.

    Position i holds the prediction for ``gen_ids[i]`` given ``prompt + gen_ids[:i]``.
    """
    if not gen_ids:
        return {"argmax": [], "margin": []}
    device = _device_of(model)
    seq = torch.tensor([prompt_ids + gen_ids[:-1]], device=device)
    n = len(gen_ids)
    try:
        logits = model(input_ids=seq, logits_to_keep=n).logits[0, -n:]
    except TypeError:
        logits = model(input_ids=seq).logits[0, -n:]
    logits = logits.float()
    top2 = logits.topk(2, dim=-1).values
    return {"argmax": logits.argmax(-1).tolist(), "margin": (top2[:, 0] - top2[:, 1]).tolist()}


@torch.inference_mode()
def measure_costs(target, draft, prompt_ids: list[int], max_n: int = 16, reps: int = 7, sync=lambda: None) -> dict:
    """Forward costs measured by the harness itself (independent of hf_specdec's own estimates).

    t_step: one target forward over 1 new token with a KV cache of the prompt; v(n) = time over n new tokens / t_step;
    t_draft: one draft forward over 1 new token; c = t_draft / t_step. The measurements are taken round-robin
    (every (model, n) once, ``reps`` times over) and each keeps its best time, so a burst of load on the machine
    does not land on one n only.
    """
    import warnings

    from transformers import DynamicCache

    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
    device = _device_of(target)
    ids = torch.tensor([prompt_ids], device=device)

    def make_step(model, cache, n: int):
        base = cache.get_seq_length()
        new = ids[:, -1:].repeat(1, n)
        pos = torch.arange(base, base + n, device=device).unsqueeze(0)

        def step():
            model(input_ids=new, past_key_values=cache, use_cache=True, position_ids=pos, logits_to_keep=n)
            cache.crop(-n)  # transformers 5: a negative count removes that many tokens

        return step

    def prefill(model):
        cache = DynamicCache()
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        return cache

    ns = sorted({n for n in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32) if n <= max_n} | {max_n})
    target_cache = prefill(target)
    steps = {("target", n): make_step(target, target_cache, n) for n in ns}
    if draft is not None:
        steps[("draft", 1)] = make_step(draft, prefill(draft), 1)
    best = {key: float("inf") for key in steps}
    for step in steps.values():  # warm
        step()
    for _ in range(reps):
        for key, step in steps.items():
            sync()
            t = time.perf_counter()
            step()
            sync()
            best[key] = min(best[key], time.perf_counter() - t)
    t_step = best[("target", 1)]
    result: dict[str, Any] = {"reps": reps, "context_tokens": len(prompt_ids), "t_step_s": t_step,
                              "v": {str(n): best[("target", n)] / t_step for n in ns}}
    if draft is not None:
        result["t_draft_s"] = best[("draft", 1)]
        result["c"] = best[("draft", 1)] / t_step
    return result


def machine_info(device: torch.device | None = None) -> dict[str, Any]:
    import platform

    import transformers

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import hf_specdec

        info["hf_specdec"] = getattr(hf_specdec, "__version__", "unknown")
    except Exception as err:  # noqa: BLE001 - recorded, not fatal
        info["hf_specdec"] = f"not importable: {type(err).__name__}"
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info["cpu_model"] = cpu
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info
