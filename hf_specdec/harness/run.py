"""One timed generation of one mode on one prompt: what every caller measures with.

``Harness(target, tokenizer, draft, settings).generate_row(mode, input_ids, seed)`` returns the measurements
of one call (a row of the eval harness, the numbers of a demo pane, the summary of ``hf-specdec generate``):

- ``new_tokens``, ``output_ids``, ``text``: what ``generate`` returned past the prompt;
- ``e2e_s``: seconds of the call (CUDA synchronised; Python's garbage collector runs before, outside it);
- ``ttft_s``: seconds to the first streamed new token; ``tpot_s`` = (e2e - ttft) / (tokens - 1);
- ``tokens_per_s`` = new tokens / e2e;
- ``target_forwards`` (a forward pre-hook on the target), ``draft_forwards`` (on the draft, modes that use it);
- ``mean_accepted_length``: tokens per target forward, prefill included (``SpecStats`` for hf_specdec modes,
  new tokens / target forwards otherwise: the same definition; plain has 1.0);
- ``spec``: ``SpecStats.to_dict()`` for hf_specdec modes, else None; ``round_log`` when hf_specdec reported
  its rounds; ``streamed_tokens``; ``peak_mem_bytes`` and ``mem_kind`` (CUDA max allocated, or the process's
  peak RSS reset before the call).

With a draft, the harness enables hf_specdec on the target (``hf_specdec.enable``) and seeds
``target.speculative_memory`` for the draft from the hardware profile (a given one, else the profile cache;
never measured here: ``formats.seed_memory``), as the first speculative call on a fresh memory would itself;
``harness.memory_seed`` says whether it was seeded and with what. transformers' modes are untouched by this
(they call the class's ``generate``).

The offline cost probe of loaded models, ``measure_costs``, lives with the profile's timing
(``hf_specdec.models.measure``); ``hf_specdec.harness`` hands it on.
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import LookaheadMemory, SpeculativeMemory, enable
from ..models.seeding import seed_speculative
from ..stats import last_spec_stats
from .encoding import EncodedPrompt, encode_prompt
from .formats import seed_memory as _seed_memory
from .modes import Settings, get_mode, plain_format
from .streaming import RoundStreamer


def device_of(model) -> torch.device:
    try:
        return model.device
    except AttributeError:
        return next(model.parameters()).device


class ForwardCounter:
    """Counts a module's forward calls (a forward pre-hook) until ``close()``."""

    def __init__(self, module):
        self.count = 0
        self._handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


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
            lines = fh.read().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("VmHWM:")), None)


class Harness:
    """The models of one comparison, and what its calls share: forward counters and, for ``lookahead_warm``,
    one ``LookaheadMemory`` (fresh per harness; ``new_memory()`` starts another task family). Each hf_specdec
    mode decodes on a ``SpeculativeMemory`` of its own (``spec_memory``), kept for the harness's life and seeded as
    the target's: modes compared in one run never learn from each other's calls.

    ``plain_targets``: copies of the target in other dtypes, ``{"fp32": model, ...}``, for the ``plain_<dtype>``
    modes (a copy may be the target itself). With a draft and ``seed_memory`` (the default), the target's
    speculative memory is seeded for the draft from ``profile`` or the profile cache (``profile_cache_dir``);
    ``memory_seed`` records the outcome (None without a draft). Every ``LookaheadMemory`` the harness makes
    (``memory``, ``new_memory()``, ``cold_memory()``) starts from the same t(n).

    Close it (or use it as a context manager) to remove the forward hooks.
    """

    def __init__(self, target, tokenizer, draft=None, settings: Settings | None = None, *,
                 plain_targets: dict[str, Any] | None = None, profile=None, profile_cache_dir=None,
                 seed_memory: bool = True):
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        self.settings = settings or Settings()
        self.device = device_of(target)
        self.cuda = self.device.type == "cuda"
        self.plain_targets = dict(plain_targets or {})
        self._target_forwards = ForwardCounter(target)
        self._draft_forwards = ForwardCounter(draft) if draft is not None else None
        self._plain_forwards = {fmt: ForwardCounter(model) for fmt, model in self.plain_targets.items()
                                if model is not target}
        self.memory_seed: dict[str, Any] | None = None
        self._seeding = (profile, profile_cache_dir) if seed_memory else None
        self._spec_memories: dict[str, SpeculativeMemory] = {}
        if draft is not None and seed_memory:
            enable(target)  # the speculative memory to seed is hf_specdec's, kept on the target
            self.memory_seed = _seed_memory(target, draft, profile=profile, cache_dir=profile_cache_dir)
        self.forward_seconds = (self.memory_seed or {}).get("forward_seconds")  # the profile's t(n), or None
        seeded = self.memory_seed is not None and self.memory_seed["seeded"]
        self._lookahead_origin = target.lookahead_memory.origin if seeded else None  # what cold memories start from
        self.memory = self.cold_memory()

    def __enter__(self) -> "Harness":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._target_forwards.close()
        if self._draft_forwards is not None:
            self._draft_forwards.close()
        for counter in self._plain_forwards.values():
            counter.close()

    def plain_target(self, fmt: str):
        """The target copy in dtype ``fmt`` that the ``plain_<fmt>`` mode decodes with."""
        try:
            return self.plain_targets[fmt]
        except KeyError:
            raise ValueError(f"mode plain_{fmt} needs the target loaded in {fmt}: Harness(plain_targets="
                             f"{{{fmt!r}: model}}) (have: {', '.join(self.plain_targets) or 'none'})") from None

    def _forward_counter(self, mode: str) -> ForwardCounter:
        fmt = plain_format(mode)
        return self._target_forwards if fmt is None else self._plain_forwards.get(fmt, self._target_forwards)

    def new_memory(self) -> None:
        self.memory = self.cold_memory()

    def spec_memory(self, mode: str) -> SpeculativeMemory:
        """The speculative memory of hf_specdec mode ``mode``, made (and seeded for the draft from the profile, as
        the target's) on its first call."""
        found = self._spec_memories.get(mode)
        if found is None:
            found = self._spec_memories[mode] = SpeculativeMemory()
            if self.draft is not None and self._seeding is not None:
                profile, cache_dir = self._seeding
                seed_speculative(found, self.target, self.draft, profile=profile, cache_dir=cache_dir)
        return found

    def cold_memory(self) -> LookaheadMemory:
        """A memory of no earlier call (no text, no acceptance) that knows this hardware's t(n) from the profile:
        what a cold lookahead call starts from, so it does not try forward sizes the profile already priced."""
        memory = LookaheadMemory()
        memory.seed(self.forward_seconds, origin=self._lookahead_origin)
        return memory

    @property
    def draft_forwards(self) -> int:
        """Draft forwards of the call running now (or of the last one): a live count for a UI."""
        return self._draft_forwards.count if self._draft_forwards is not None else 0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def encode(self, text: str, **kwargs) -> EncodedPrompt:
        """:func:`~hf_specdec.harness.encoding.encode_prompt` with this harness's tokenizer and device."""
        return encode_prompt(self.tokenizer, text, device=self.device, **kwargs)

    def generate_kwargs(self, input_ids: torch.LongTensor,  # [1, L]
                        streamer, settings: Settings, max_new_tokens: int) -> dict[str, Any]:
        """The ``generate`` arguments every mode shares."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        kwargs: dict[str, Any] = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                      max_new_tokens=max_new_tokens, streamer=streamer, pad_token_id=pad)
        if settings.temperature > 0:
            # the same plain distribution for every mode: no top-k/top-p from generation_config
            kwargs.update(do_sample=True, temperature=settings.temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False)
        return kwargs

    def generate_row(self, mode: str,
                     input_ids: torch.LongTensor,  # [1, L] the prompt, on this harness's device
                     seed: int = 0, max_new_tokens: int | None = None, *, settings: Settings | None = None,
                     streamer: RoundStreamer | None = None) -> dict[str, Any]:
        """Run ``mode`` once on ``input_ids`` and measure it (see the module docstring).

        ``settings`` default to the harness's; ``streamer`` (default: a fresh one) lets a caller watch the
        rounds or cancel the call. Raises what the call raises (``ValueError`` for a mode that needs a draft
        when there is none).
        """
        spec = get_mode(mode)
        if spec.needs_draft and self.draft is None:
            raise ValueError(f"mode {mode} needs a draft model")
        if plain_format(mode) is not None:
            self.plain_target(plain_format(mode))  # refuses a dtype the harness holds no copy in
        settings = settings or self.settings
        streamer = streamer or RoundStreamer(sync=self.sync)
        kwargs = self.generate_kwargs(input_ids, streamer, settings, max_new_tokens or settings.max_new_tokens)
        saved = [(m, copy.deepcopy(m.generation_config)) for m in (self.target, self.draft) if m is not None]
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        rss_ok = not self.cuda and _rss_reset()
        torch.manual_seed(seed)
        if self.cuda:
            torch.cuda.manual_seed_all(seed)
        for counter in (self._target_forwards, self._draft_forwards, *self._plain_forwards.values()):
            if counter is not None:
                counter.count = 0
        gc.collect()  # no collection of earlier garbage inside the timed window
        try:
            self.sync()
            start = time.perf_counter()
            with torch.inference_mode():
                out = spec.call(self, settings, kwargs)
            self.sync()
            end = time.perf_counter()
        finally:
            for model, generation_config in saved:
                model.generation_config = generation_config
        return self._row(spec, input_ids, out, start, end, streamer, rss_ok)

    def _row(self, spec, input_ids, out, start: float, end: float, streamer: RoundStreamer, rss_ok: bool) -> dict:
        forwards = self._forward_counter(spec.name).count
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
        if spec.needs_draft:
            row["draft_forwards"] = self.draft_forwards
        if self.cuda:
            row.update(peak_mem_bytes=int(torch.cuda.max_memory_allocated(self.device)), mem_kind="cuda_max_allocated")
        else:
            row.update(peak_mem_bytes=_rss_peak(), mem_kind="rss_peak" if rss_ok else "rss_peak_process")
        # this thread's latest call's (each call resets them when it starts: a failed call shows none)
        stats = last_spec_stats(self.target) if spec.hf_specdec else None
        if stats is not None:
            row["spec"] = stats.to_dict()
            rounds = row["spec"].get("rounds")
            row["mean_accepted_length"] = row["spec"].get("mean_accepted_length") or (n / rounds if rounds else None)
        else:
            row["spec"] = None
            # tokens per target forward (prefill included), the same definition as SpecStats.mean_accepted_length
            row["mean_accepted_length"] = n / forwards if forwards else None
        if streamer.round_log:
            row["round_log"] = streamer.round_log
        return row


def warm_up(run_once: Callable[[str], object], modes: Iterable[str], rounds: int = 1) -> dict[str, str]:
    """Untimed calls ``run_once(mode)`` of every mode (kernels, allocator, lazy imports, caches), so that the
    first timed call of a mode pays no one-off costs the others skip. Returns ``{mode: error}`` for the modes
    that failed (they are not tried again); the timed calls then report their errors themselves."""
    failed: dict[str, str] = {}
    for _ in range(rounds):
        for mode in modes:
            if mode in failed:
                continue
            try:
                run_once(mode)
            except Exception as err:  # noqa: BLE001 - returned to the caller, who shows it
                failed[mode] = f"{type(err).__name__}: {err}"
    return failed
