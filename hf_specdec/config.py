"""Frozen, validated configuration objects.

Every config is a frozen dataclass checked in ``__post_init__``; a bad value raises ``ValueError`` that names
the field, what it got and what is allowed. ``from_dict`` rejects unknown keys the same way, so a typo in a
CLI flag or a JSON file never passes silently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Union

POLICIES = ("adaptive", "fixed", "heuristic")
Auto = Literal["auto"]


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
        worth its cost (see ``policy.py``).
    probe_interval:
        Adaptive only: while speculation is off, draft again after this many plain rounds to re-measure.
    decay:
        Adaptive only: weight kept by old observations per round (exponential forgetting), in (0, 1].
    history_lookup:
        Adaptive only: after the draft model's tokens, append the continuation that followed the same tokens
        earlier in the prompt or the output (prompt lookup), as many tokens as the expected-rate rule says pay
        for their measured extra verify time. They cost no draft forward; verification keeps output exact.
    draft_vocab_size:
        Compute the draft's output layer over only this many token ids (the first ids of a BPE vocabulary are
        its most frequent tokens), plus every prompt token and the special tokens. On a memory-bound CPU the
        draft's output layer over a 150k vocabulary costs as much as its 4-bit body. The target still scores
        every token, so output is unchanged; only what the draft can propose narrows. ``"auto"``: 32768 when
        the vocabulary is larger than 65536, else off; ``None``: off.
    """

    policy: Literal["adaptive", "fixed", "heuristic"] = "adaptive"
    num_draft_tokens: int = 4
    max_draft_tokens: int = 16
    confidence_stop: bool = True
    probe_interval: int = 16
    decay: float = 0.95
    history_lookup: bool = True
    draft_vocab_size: Union[int, Auto, None] = "auto"

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.policy not in POLICIES:
            _fail(name, "policy", self.policy, f"choose one of {list(POLICIES)}")
        _check_int(name, "max_draft_tokens", self.max_draft_tokens, 1, 64)
        _check_int(name, "num_draft_tokens", self.num_draft_tokens, 1, self.max_draft_tokens)
        if not isinstance(self.confidence_stop, bool):
            _fail(name, "confidence_stop", self.confidence_stop, "use True or False")
        _check_int(name, "probe_interval", self.probe_interval, 1)
        _check_float(name, "decay", self.decay, 0.5, 1.0)
        if not isinstance(self.history_lookup, bool):
            _fail(name, "history_lookup", self.history_lookup, "use True or False")
        if self.draft_vocab_size not in ("auto", None):
            _check_int(name, "draft_vocab_size", self.draft_vocab_size, 16)


@dataclass(frozen=True)
class LookaheadConfig(_FromDict):
    """Lookahead decoding (Jacobi window + n-gram pool), no draft model.

    window: W, future positions decoded in parallel by Jacobi iteration (``"auto"``: chosen from the measured
        cost of one forward as a function of its token count).
    ngram: N, n-gram length harvested from the window and stored in the pool (``"auto"`` likewise).
    max_candidates: G, most pool candidates verified per step (``"auto"`` likewise).
    pool_from_prompt: seed the n-gram pool from the prompt and from generated text.
    max_pool_per_key: n-grams kept per first token (least recently used ones are evicted).
    """

    window: Union[int, Auto] = "auto"
    ngram: Union[int, Auto] = "auto"
    max_candidates: Union[int, Auto] = "auto"
    pool_from_prompt: bool = True
    max_pool_per_key: int = 16

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field, low, high in (("window", 1, 64), ("ngram", 2, 16), ("max_candidates", 0, 64)):
            value = getattr(self, field)
            if value != "auto":
                _check_int(name, field, value, low, high)
        if not isinstance(self.pool_from_prompt, bool):
            _fail(name, "pool_from_prompt", self.pool_from_prompt, "use True or False")
        _check_int(name, "max_pool_per_key", self.max_pool_per_key, 1, 1024)
