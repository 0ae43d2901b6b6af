"""Frozen, validated configuration objects.

Every config is a frozen dataclass checked in ``__post_init__``; a bad value raises ``ValueError`` that names
the field, what it got and what is allowed. ``from_dict`` rejects unknown keys the same way, so a typo in a
CLI flag or a JSON file never passes silently.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Literal, Union

Auto = Literal["auto"]
AUTO_DRAFT_VOCAB = 32768  # draft_vocab_size "auto": the draft's output layer over this many ids ...
NARROW_ABOVE = 65536  # ... where the vocabulary is larger than this


def auto_draft_vocab_size(vocab_size: int) -> int | None:
    """The ids a draft's output layer scores under ``draft_vocab_size="auto"`` (None: all of them): the one rule
    the drafter and the hardware profile's draft measurements share.

    >>> auto_draft_vocab_size(151936), auto_draft_vocab_size(49152)
    (32768, None)
    """
    return AUTO_DRAFT_VOCAB if vocab_size > NARROW_ABOVE else None


class TreeMode(enum.StrEnum):
    """Whether a draft model's round may verify a tree of its likely continuations (``SpecConfig.tree``)."""

    AUTO = "auto"  # a tree where the planner expects it to emit more tokens per second than the chain
    ON = "on"  # a tree in every round that drafts (one that branches), whatever the costs say
    OFF = "off"  # a chain, as before trees


class PolicyKind(enum.StrEnum):
    """How a draft model's k is chosen (``SpecConfig.policy``; ``policy.make_policy`` builds it). A member equals
    and formats as its value, so ``policy="fixed"`` and ``PolicyKind.FIXED`` are the same setting.

    >>> PolicyKind("fixed") is PolicyKind.FIXED, PolicyKind.FIXED == "fixed", f"specdec_{PolicyKind.FIXED}"
    (True, True, 'specdec_fixed')
    """

    ADAPTIVE = "adaptive"  # the planner: k from measured costs and acceptance, speculation off where it does not pay
    FIXED = "fixed"  # always num_draft_tokens
    HEURISTIC = "heuristic"  # transformers' rule (+2 after a fully kept round, -1 otherwise), a reference


def _fail(cls_name: str, field: str, got: Any, allowed: str) -> None:
    raise ValueError(f"{cls_name}.{field}={got!r} is invalid: {allowed}.")


def _check_int(cls_name: str, field: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"
        _fail(cls_name, field, value, f"use {bound}")


def _check_float(cls_name: str, field: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value <= high):
        _fail(cls_name, field, value, f"use a number in [{low}, {high}]")


class _FromDict:
    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        """Build from a plain dict, refusing keys this config does not have."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"{cls.__name__} got unknown key(s) {unknown}; known keys are {sorted(known)}."
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SpecConfig(_FromDict):
    """How speculative decoding with a draft model chooses its draft length.

    policy:
        ``"adaptive"`` (default) picks k every round to maximise expected tokens per second from measured
        acceptance and measured draft/verify costs, stops drafting early on low draft confidence and turns
        speculation off (k = 0) when it does not pay; ``"fixed"`` always drafts ``num_draft_tokens``;
        ``"heuristic"`` is transformers' rule (+2 after a fully accepted round, -1 otherwise), kept as a reference.
    num_draft_tokens:
        k for ``"fixed"``, and the starting k for ``"heuristic"`` and ``"adaptive"``.
    max_draft_tokens:
        Upper bound on k for every policy (adaptive rounds reach it only while the draft stays confident).
    confidence_stop:
        Adaptive only: stop drafting inside a round when the draft's confidence says the next token is not
        worth its cost (see ``policy.py``). One prompt at a time: a batch drafts one k for all its rows.
    probe_interval:
        Adaptive only: while speculation is off, draft again after this many plain rounds to re-measure; after
        each probe that does not turn it back on, the interval doubles (up to 1024 rounds).
    max_regret:
        Adaptive only: the most time probing may lose against plain decoding, as a share of the time plain
        decoding would have taken for the tokens emitted so far (a probe that would go past it waits); the
        account is carried to the next call on the same memory at half, as lookahead's is.
    setup_margin:
        Adaptive only: the draft model reads the prompts (its prefill, which cannot be undone) only when
        drafting the tokens left is expected to save this many times what the read costs: the read is certain,
        the saving an estimate. At 1.0 a break-even bet is taken (measured: a batch of 8 that read its draft's
        prompts for an expected saving about that size ran at 0.92x plain).
    decay:
        Adaptive only: weight kept by old observations per round (exponential forgetting), in (0, 1].
    history_lookup:
        Prompt lookup beside the draft model: the continuation that followed the same tokens earlier in the
        prompt or the output. The adaptive policy appends as many such tokens after the draft model's as its
        expected-rate rule says pay for their measured extra verify time, and verifies a continuation alone (no
        draft forward) when that beats drafting; fixed and heuristic policies never use it, nor does a batch.
        Verification keeps output exact.
    tree:
        ``"auto"`` (default): where a target forward over more tokens costs about what one costs (a GPU, a CPU
        with bf16 units), a round may verify a tree of the draft's likely continuations (its top choices where it
        is unsure, grown by cumulative draft probability) in one forward; the planner picks the tree only where
        it expects more tokens per second than the chain, so where t(n) is steep (fp32 on a CPU) the rounds
        stay chains. ``"on"``: every round that drafts verifies a tree that branches (tests, measurements);
        ``"off"``: chains only. Adaptive policy only, one prompt or a batch (each row its own tree); output is
        unchanged either way.
    draft_vocab_size:
        Compute the draft's output layer over only this many token ids (the first ids of a BPE vocabulary are
        its most frequent tokens), plus every prompt token and the special tokens. On a memory-bound CPU the
        draft's output layer over a 150k vocabulary costs as much as its 4-bit body. The target still scores
        every token, so output is unchanged; only what the draft can propose narrows. ``"auto"``: 32768 when
        the vocabulary is larger than 65536, else off (``auto_draft_vocab_size``; the hardware profile times
        draft steps with the same head); ``None``: off.
    """

    policy: PolicyKind | Literal["adaptive", "fixed", "heuristic"] = "adaptive"  # a PolicyKind or its value
    num_draft_tokens: int = 4
    max_draft_tokens: int = 16
    confidence_stop: bool = True
    probe_interval: int = 16
    max_regret: float = 0.03
    setup_margin: float = 2.0
    decay: float = 0.95
    history_lookup: bool = True
    tree: Literal["auto", "on", "off"] = "auto"
    draft_vocab_size: Union[int, Auto, None] = "auto"

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.policy not in tuple(PolicyKind):
            _fail(name, "policy", self.policy, f"choose one of {[kind.value for kind in PolicyKind]}")
        _check_int(name, "max_draft_tokens", self.max_draft_tokens, 1, 64)
        _check_int(name, "num_draft_tokens", self.num_draft_tokens, 1, self.max_draft_tokens)
        if not isinstance(self.confidence_stop, bool):
            _fail(name, "confidence_stop", self.confidence_stop, "use True or False")
        _check_int(name, "probe_interval", self.probe_interval, 1)
        _check_float(name, "max_regret", self.max_regret, 0.0, 1.0)
        _check_float(name, "setup_margin", self.setup_margin, 1.0, 100.0)
        _check_float(name, "decay", self.decay, 0.5, 1.0)
        if not isinstance(self.history_lookup, bool):
            _fail(name, "history_lookup", self.history_lookup, "use True or False")
        if self.tree not in tuple(TreeMode):
            _fail(name, "tree", self.tree, f"choose one of {[mode.value for mode in TreeMode]}")
        if self.tree == TreeMode.ON and self.policy != PolicyKind.ADAPTIVE:
            _fail(name, "tree", self.tree, f"a tree is sized by the adaptive policy; use policy='adaptive' with "
                                           f"tree='on', or tree='off' with policy={self.policy!r}")
        if self.draft_vocab_size not in ("auto", None):
            _check_int(name, "draft_vocab_size", self.draft_vocab_size, 16)


@dataclass(frozen=True)
class LookaheadConfig(_FromDict):
    """Lookahead decoding (Jacobi window + n-gram pool + prompt lookup + recycling, verified as a trie), no draft
    model. ``"auto"`` sizes come from the measured forward cost and the learned acceptance of each source of
    guesses (``policy.Planner``); the rest are the tunables of that rule, with the values measured best.
    """

    window: Union[int, Auto] = "auto"  # W, Jacobi columns decoded in parallel ("auto": only where nearly free)
    ngram: Union[int, Auto] = "auto"  # N, n-gram length harvested from the window into the pool
    max_candidates: Union[int, Auto] = "auto"  # G, pool candidates verified per step ("auto": by expected rate)
    pool_from_prompt: bool = True  # prompt lookup over prompt + generated text as a source of candidates
    max_pool_per_key: int = 16  # n-grams kept per first token, least recently used evicted
    max_depth: int = 32  # the deepest candidate ever proposed
    max_forward_tokens: int = 64  # never more inputs than this in one forward
    # the window only gets tokens that keep the forward within this share of its cost without it ...
    window_tolerance: float = 0.15
    # ... and only while the tokens its pool adds per round (beyond prompt lookup), as a share of the tokens a
    # round emits, exceed that share; this optimistic prior lets it be tried first
    prior_pool_gain: float = 0.3
    remeasure_interval: int = 16  # a round with nothing to verify is a plain step if t(1) is older than this
    max_candidates_per_source: int = 8  # prompt-lookup continuations and pool n-grams considered per round, each
    history_match: int = 4  # longest context match prompt lookup looks for (a longer match predicts better)
    # Token Recycling (Luo et al. 2025): the target's top `recycle_width` choices are kept per token; a round
    # proposes a chain from each of the top `recycle_branches` choices after the last token and from each of the
    # next `recycle_second` choices after the top one, each up to `recycle_depth` tokens. Measured on HumanEval
    # (8 prompts, interleaved with prompt lookup, AMD EPYC avx512_bf16): 4/4/3 beat 4/3/0 and 8/6/5.
    recycle_width: int = 4
    recycle_branches: int = 4
    recycle_second: int = 3
    recycle_depth: int = 8
    acceptance_decay: float = 0.98  # weight kept by old observations of a source's acceptance, per observation
    # the most time guesses may lose against plain decoding, as a share of plain decoding's time for the tokens
    # emitted so far; each round is sized so that even if every guess is rejected the loss stays within it. Half
    # of the 3% the "never below 0.97x plain" floor allows: the loop's own host work per round and run-to-run
    # noise take the rest (a CPU limited to AVX2, fp32: a 3% budget spent in full gave 0.954x on one prompt)
    max_regret: float = 0.015

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field, low, high in (("window", 1, 64), ("ngram", 2, 16), ("max_candidates", 0, 64)):
            value = getattr(self, field)
            if value != "auto":
                _check_int(name, field, value, low, high)
        if not isinstance(self.pool_from_prompt, bool):
            _fail(name, "pool_from_prompt", self.pool_from_prompt, "use True or False")
        _check_int(name, "max_pool_per_key", self.max_pool_per_key, 1, 1024)
        _check_int(name, "max_depth", self.max_depth, 1, 256)
        _check_int(name, "max_forward_tokens", self.max_forward_tokens, 2, 1024)
        _check_float(name, "window_tolerance", self.window_tolerance, 0.0, 1.0)
        _check_float(name, "prior_pool_gain", self.prior_pool_gain, 0.0, 1.0)
        _check_int(name, "remeasure_interval", self.remeasure_interval, 1)
        _check_int(name, "max_candidates_per_source", self.max_candidates_per_source, 1, 64)
        _check_int(name, "history_match", self.history_match, 1, 16)
        _check_int(name, "recycle_width", self.recycle_width, 1, 64)
        _check_int(name, "recycle_branches", self.recycle_branches, 0, self.recycle_width)
        _check_int(name, "recycle_second", self.recycle_second, 0, self.recycle_width - 1)
        _check_int(name, "recycle_depth", self.recycle_depth, 1, 256)
        _check_float(name, "acceptance_decay", self.acceptance_decay, 0.5, 1.0)
        _check_float(name, "max_regret", self.max_regret, 0.0, 1.0)
