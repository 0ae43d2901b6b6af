"""Decoding modes: every way the eval harness, the demo, the bench presets and ``hf-specdec generate`` decode.

- ``plain``: transformers ``generate``, no speculation: the baseline.
- ``hf_assisted``: transformers assisted generation with the draft and transformers' defaults (20 tokens,
  "constant" schedule, confidence stop 0.4 with ROC re-tuning).
- ``hf_assisted_k3``, ``hf_assisted_k5``: the same with a fixed k. The draft's generation_config gets
  ``num_assistant_tokens=k``, ``num_assistant_tokens_schedule="constant"`` and
  ``assistant_confidence_threshold=0`` (else the confidence stop makes k variable), restored afterwards
  (transformers ignores kwargs to ``generate`` for these).
- ``hf_prompt_lookup``: transformers prompt lookup, ``prompt_lookup_num_tokens=10``.
- ``specdec_adaptive``, ``specdec_fixed``, ``specdec_heuristic``: hf_specdec with the draft,
  ``SpecConfig(policy=..., num_draft_tokens=spec_k)`` (``max_draft_tokens``: its default, or spec_k if larger).
- ``specdec_chain``, ``specdec_tree``: ``specdec_adaptive`` with ``tree="off"`` (one chain a round) and
  ``tree="on"`` (the best tree that branches); ``specdec_adaptive`` itself is ``tree="auto"``, the default.
  Each hf_specdec mode decodes on a speculative memory of its own (``Harness.spec_memory``).
- ``lookahead``: hf_specdec lookahead, no draft; cold: a fresh memory per call (no call learns from another),
  which knows only the hardware profile's t(n) (``Harness.cold_memory``).
- ``lookahead_warm``: hf_specdec lookahead with the harness's one ``LookaheadMemory`` (one run, one task
  family): each call reads the earlier warm calls' prompts, outputs and measurements.
- ``plain_bf16``, ``plain_fp16``, ``plain_fp32`` (``PLAIN_DTYPE_MODES``, not in ``MODES``): plain decoding of
  the same target loaded in that dtype, a copy the harness holds (``Harness(plain_targets={"fp32": model})``),
  so that one comparison can time plain decoding in every dtype against the others.

transformers' modes run the unmodified transformers ``generate``: ``type(model).generate(model, ...)`` skips
the per-instance override that ``hf_specdec.enable`` installs. hf_specdec's modes ``enable`` the target first.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from .. import LookaheadConfig, LookaheadMemory, SpecConfig, SpeculativeMemory, enable
from ..config import PolicyKind, TreeMode

ASSISTANT_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


@dataclass(frozen=True)
class Settings:
    """How every mode decodes: the same for all modes of one comparison."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy; > 0: plain sampling (no top-k/top-p) for every mode
    spec_k: int = 4  # k of specdec_fixed, the starting k of specdec_heuristic and specdec_adaptive
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)


class Models(Protocol):
    """What a mode decodes with: the models of one comparison and the lookahead memories (``run.Harness`` is
    one). Modes name this, not the harness, so that the harness imports the modes and not the other way round."""

    target: Any
    draft: Any
    memory: LookaheadMemory

    def cold_memory(self) -> LookaheadMemory: ...

    def spec_memory(self, mode: str) -> SpeculativeMemory: ...

    def plain_target(self, fmt: str) -> Any: ...


@dataclass(frozen=True)
class Mode:
    """One decoding mode: ``call(models, settings, kwargs)`` runs it with the common ``generate`` kwargs."""

    name: str
    title: str
    needs_draft: bool
    hf_specdec: bool  # decoded by hf_specdec: its SpecStats land in ``model.last_spec_stats``
    call: Callable[[Models, Settings, dict[str, Any]], Any]


def _transformers(**extra) -> Callable:
    def call(h: Models, settings: Settings, kwargs: dict[str, Any]):
        return type(h.target).generate(h.target, **kwargs, **extra)

    return call


@contextlib.contextmanager
def _assistant_tokens(draft, k: int | None) -> Iterator[None]:
    """Fix transformers' draft length at ``k`` on the draft's generation_config (None: its defaults), restore it."""
    config = draft.generation_config
    saved = {key: getattr(config, key, None) for key in ASSISTANT_KEYS}
    try:
        if k is not None:
            config.num_assistant_tokens = k
            config.num_assistant_tokens_schedule = "constant"
            config.assistant_confidence_threshold = 0.0
        yield
    finally:
        for key, value in saved.items():
            setattr(config, key, value)


# transformers' assisted generation (5.x) drafts every round with ``assistant_model.generate(generation_config=...,
# min_new_tokens=..., max_new_tokens=..., use_cache=...)`` (candidate_generator.py), and its own
# ``_prepare_generation_config`` answers that call with "Passing `generation_config` together with generation-related
# arguments=({...}) is deprecated" (once per process). The caller it addresses is transformers itself, not the demo
# or the harness, whose calls pass no generation_config: nothing a user could change.
_TRANSFORMERS_GENERATE_LOGGER = "transformers.generation.utils"
_DEPRECATION_PREFIX = "Passing `generation_config` together with generation-related arguments="
_DRAFT_CALL_ARGUMENTS = frozenset({"min_new_tokens", "max_new_tokens", "use_cache"})  # what the draft call adds


class _DraftCallDeprecation(logging.Filter):
    """Drops that one warning when it names only the arguments of transformers' own draft call (above); the same
    warning about a caller's own arguments passes.

    >>> quiet = _DraftCallDeprecation()
    >>> def record(message):
    ...     return logging.LogRecord("transformers.generation.utils", logging.WARNING, __file__, 0, message, None, None)
    >>> quiet.filter(record(_DEPRECATION_PREFIX + "({'use_cache', 'max_new_tokens', 'min_new_tokens'}) is deprecated"))
    False
    >>> quiet.filter(record(_DEPRECATION_PREFIX + "({'temperature', 'max_new_tokens'}) is deprecated"))
    True
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(_DEPRECATION_PREFIX):
            return True
        named = set(re.findall(r"'(\w+)'", message.split(")", 1)[0]))
        return not named or not named <= _DRAFT_CALL_ARGUMENTS


@contextlib.contextmanager
def _without_draft_call_deprecation() -> Iterator[None]:
    """While transformers' assisted generation runs, drop the deprecation warning it raises about its own draft
    calls (``_DraftCallDeprecation``)."""
    logger, quiet = logging.getLogger(_TRANSFORMERS_GENERATE_LOGGER), _DraftCallDeprecation()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _assisted(k: int | None) -> Callable:
    def call(h: Models, settings: Settings, kwargs: dict[str, Any]):
        with _assistant_tokens(h.draft, k), _without_draft_call_deprecation():
            return type(h.target).generate(h.target, **kwargs, assistant_model=h.draft)

    return call


def _specdec(name: str, policy: PolicyKind, tree: TreeMode = TreeMode.AUTO) -> Callable:
    def call(h: Models, settings: Settings, kwargs: dict[str, Any]):
        k = settings.spec_k
        config = SpecConfig(policy=policy, num_draft_tokens=k, max_draft_tokens=max(SpecConfig.max_draft_tokens, k),
                            tree=tree if policy is PolicyKind.ADAPTIVE else TreeMode.OFF)
        return enable(h.target).generate(**kwargs, assistant_model=h.draft, spec_config=config,
                                         speculative_memory=h.spec_memory(name))

    return call


def _lookahead(warm: bool) -> Callable:
    def call(h: Models, settings: Settings, kwargs: dict[str, Any]):
        return enable(h.target).generate(**kwargs, decoding="lookahead", lookahead_config=settings.lookahead,
                                         lookahead_memory=h.memory if warm else h.cold_memory())

    return call


MODES = MappingProxyType({mode.name: mode for mode in (
    Mode("plain", "Plain (transformers)", False, False, _transformers()),
    Mode("hf_assisted", "Transformers assisted", True, False, _assisted(None)),
    Mode("hf_assisted_k3", "Transformers assisted, k=3", True, False, _assisted(3)),
    Mode("hf_assisted_k5", "Transformers assisted, k=5", True, False, _assisted(5)),
    Mode("hf_prompt_lookup", "Transformers prompt lookup", False, False, _transformers(prompt_lookup_num_tokens=10)),
    *(Mode(f"specdec_{kind}", f"hf_specdec ({kind})", True, True, _specdec(f"specdec_{kind}", kind))
      for kind in PolicyKind),  # specdec_adaptive, specdec_fixed, specdec_heuristic: every --policy has its mode
    Mode("specdec_chain", "hf_specdec (adaptive, chain only)", True, True,
         _specdec("specdec_chain", PolicyKind.ADAPTIVE, TreeMode.OFF)),
    Mode("specdec_tree", "hf_specdec (adaptive, trees on)", True, True,
         _specdec("specdec_tree", PolicyKind.ADAPTIVE, TreeMode.ON)),
    Mode("lookahead", "Lookahead (hf_specdec)", False, True, _lookahead(warm=False)),
    Mode("lookahead_warm", "Lookahead with memory (hf_specdec)", False, True, _lookahead(warm=True)),
)})
DRAFT_MODES = tuple(name for name, mode in MODES.items() if mode.needs_draft)
PLAIN_FORMATS = ("bf16", "fp16", "fp32")


def _plain_copy(fmt: str) -> Callable:
    def call(h: Models, settings: Settings, kwargs: dict[str, Any]):
        model = h.plain_target(fmt)
        return type(model).generate(model, **kwargs)

    return call


PLAIN_DTYPE_MODES = MappingProxyType({f"plain_{fmt}": Mode(f"plain_{fmt}", f"Plain (transformers), {fmt} target",
                                                           False, False, _plain_copy(fmt)) for fmt in PLAIN_FORMATS})


def plain_format(name: str) -> str | None:
    """The dtype of a ``plain_<dtype>`` mode ("bf16", "fp16", "fp32"), None for every other mode."""
    return name.removeprefix("plain_") if name in PLAIN_DTYPE_MODES else None


def get_mode(name: str) -> Mode:
    found = MODES.get(name) or PLAIN_DTYPE_MODES.get(name)
    if found is None:
        raise ValueError(f"unknown mode {name!r}; known: {list(MODES) + list(PLAIN_DTYPE_MODES)}")
    return found


def parse_modes(text: str, baseline: str | None = "plain") -> list[str]:
    """Comma-separated mode names, checked; ``baseline`` is put first when missing (speedups and parity are
    measured against it)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES and m not in PLAIN_DTYPE_MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; known: {list(MODES) + list(PLAIN_DTYPE_MODES)}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"duplicate modes in {text!r}")
    if baseline is not None and baseline not in modes:
        modes.insert(0, baseline)
    return modes
