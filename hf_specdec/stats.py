"""SpecStats: what happened during one speculative (or lookahead) ``generate`` call.

Definitions, used the same way by the loop, the eval harness and the demo:

- round: one target forward that emits tokens, for one row. The prefill is round 0 (it emits the first token),
  every later target forward is one round, whether it verified draft tokens (a speculative round) or not (a
  plain round, k = 0, "speculation off"). With a batch of B rows a forward is B rounds (row-rounds);
  ``forwards`` counts the forwards themselves.
- drafted / accepted: draft tokens sent to the target for verification (every node of a trie) / kept by it
  (see ``verify.py``). A round's draft length is the depth of its trie (a chain's length).
- mean accepted length: ``new_tokens / rounds`` = tokens emitted per target forward, bonus/recovered token
  included; it equals ``1 + accepted / rounds`` when no stop truncated the last round. This is vLLM's
  "mean acceptance length" and the "compression ratio" of EAGLE and LookaheadDecoding. Plain decoding has 1.0.
- acceptance per position i: of the rounds that drafted to depth i or deeper, the share that accepted a token at
  depth i.
- tree round: a round whose guesses branch (some node has two or more children): a draft-model tree, or a
  lookahead trie. Nodes verified = drafted. Tokens per target forward: tokens a row emits per target forward
  after the prefill (``tokens_per_forward``; the prefill's one token a row is left out).
- acceptance by depth and rank: of the draft model's nodes at depth d that were the r-th choice among their
  siblings (r = 0: the first choice, a chain's only one) and were judged (their parent was kept), the share
  kept (``acceptance_by_depth_rank``; what the planner learns as ``Source(DRAFT, r, d)``).
- c (cost ratio): mean time of one draft forward / mean time of one plain target step.
- v(n): mean time of a target forward over n new tokens / the same for one token, on this hardware.
- first estimates: where the costs and acceptance the call started from came from (``memory.EstimatesFrom``): the
  hardware profile (a memory's first call, seeded from the cached profile), earlier calls on the same memory,
  given costs, or priors (no profile: its first round is a plain step and its first draft length a guess).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from .memory import EstimatesFrom
from .round import PlainReason, RoundOutcome, SourceKind


@dataclass
class SpecStats:
    mode: str = "speculative"
    rows: int = 1  # prompts decoded together (the batch size)
    rounds: int = 0  # row-rounds: each target forward counts once per row it decoded
    forwards: int = 0  # target forwards after the prefill
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds_spec_off: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_length_hist: Counter = field(default_factory=Counter)
    round_log: list[tuple[int, int]] = field(default_factory=list)
    draft_time_s: float = 0.0
    draft_forwards: int = 0
    draft_setup_time_s: float = 0.0  # the draft reading the prompt, once, when first used (not in draft_time_s)
    verify_time_s: float = 0.0
    compactions: int = 0  # times the target's cache gathered its kept columns together (after a round's keep)
    compact_time_s: float = 0.0  # their seconds: a step of its own, not in verify_time_s
    prefill_time_s: float = 0.0
    total_time_s: float = 0.0
    ttft_s: float | None = None
    verify_time_by_tokens: dict[int, list[float]] = field(default_factory=dict)
    lookup_drafted: int = 0  # draft tokens no draft model produced (prompt lookup, pool, recycling)
    lookup_accepted: int = 0
    fell_back: str | None = None  # why speculation was switched off for the rest of the call (e.g. out of memory)
    guess_cap: int | None = None  # after a round ran out of memory: the most guesses per row from then on
    plain_reasons: Counter = field(default_factory=Counter)  # why the planner chose plain rounds: PlainReason -> rounds
    plain_wording: dict[PlainReason, str] = field(default_factory=dict)  # each kind's newest full wording
    tree_rounds: int = 0  # row-rounds whose guesses branched
    tree_nodes: int = 0  # nodes those rounds verified
    judged_by_depth_rank: Counter = field(default_factory=Counter)  # (depth, rank) -> draft-model nodes judged
    accepted_by_depth_rank: Counter = field(default_factory=Counter)  # (depth, rank) -> of them, kept
    cache_bytes: int = 0  # the target's KV cache at the end of the call (all rows, padding columns included)
    draft_cache_bytes: int = 0  # the drafter's own caches at the end of the call (a draft model's KV cache)
    estimates_from: EstimatesFrom | None = None  # where the call's first estimates came from (``memory.Seeding``)
    estimates_why: str = ""  # its wording: "seeded from the cached hardware profile: target t(n) in fp32 at ..."

    # -- recording ------------------------------------------------------------------------------------------
    def record_prefill(self, seconds: float, emitted: int) -> None:
        """Round 0: the target read the prompt and emitted its first token(s) in ``seconds``."""
        self.rounds += self.rows
        self.new_tokens += emitted
        self.prefill_time_s += seconds
        self.ttft_s = seconds if self.ttft_s is None else self.ttft_s
        self.round_log.extend([(0, 1)] * self.rows)

    def record(self, outcomes: Sequence[RoundOutcome]) -> None:
        """One round: one target forward over every active row (see ``round.RoundOutcome``). Per row: drafted =
        its proposal's tokens (trie nodes), its draft length is its deepest path, positions are depths, lookup
        tokens are those no draft model produced. A round of B rows counts B row-rounds in ``rounds``."""
        first = outcomes[0]
        self.forwards += 1
        self.verify_time_s += first.verify_time
        self.verify_time_by_tokens.setdefault(first.forward_tokens, []).append(first.verify_time)
        self.compactions += bool(first.compacted)
        self.compact_time_s += first.compact_time
        self.draft_forwards += max(outcome.proposal.draft_forwards for outcome in outcomes)
        for outcome in outcomes:
            self._record_row(outcome)

    def _record_row(self, outcome: RoundOutcome) -> None:
        proposal = outcome.proposal
        drafted, accepted, emitted = proposal.num_tokens, outcome.num_accepted, len(outcome.emitted)
        depth = proposal.depth
        self.rounds += 1
        self.new_tokens += emitted
        self.drafted += drafted
        self.accepted += accepted
        self.draft_length_hist[depth] += 1
        if drafted == 0:
            self.rounds_spec_off += 1
            if outcome.plan.plain_why is not None:  # counted by its kind; its wording "<kind>: <this round's numbers>"
                kind = outcome.plan.plain_why.kind
                self.plain_reasons[kind] += 1
                self.plain_wording[kind] = outcome.plan.why
        while len(self.drafted_per_position) < depth:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(depth):
            self.drafted_per_position[i] += 1
            if i < accepted:
                self.accepted_per_position[i] += 1
        self.round_log.append((min(accepted, emitted), emitted))
        self.draft_time_s += proposal.draft_time
        self.draft_setup_time_s += proposal.setup_time
        from_lookup = [all(s.kind != SourceKind.DRAFT for s in sources) for sources in proposal.sources]  # (str kinds too)
        self.lookup_drafted += sum(from_lookup)
        self.lookup_accepted += sum(from_lookup[node] for node in outcome.accepted)
        if proposal.branches:
            self.tree_rounds += 1
            self.tree_nodes += drafted
        kept, judged = set(outcome.accepted), outcome.judged()
        for node, sources in enumerate(proposal.sources):
            for source in sources:
                if source.kind == SourceKind.DRAFT and judged[node]:
                    self.judged_by_depth_rank[source.position, source.variant] += 1
                    self.accepted_by_depth_rank[source.position, source.variant] += node in kept

    # -- derived ----------------------------------------------------------------------------------------------
    @property
    def mean_accepted_length(self) -> float:
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (vLLM's "draft acceptance rate"; it falls as k grows, unlike per-token alpha)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_forward(self) -> float:
        """Tokens a row emits per target forward after the prefill (1.0 for plain decoding)."""
        rounds = self.rounds - self.rows
        return (self.new_tokens - self.rows) / rounds if rounds > 0 else 0.0

    @property
    def acceptance_by_depth_rank(self) -> dict[tuple[int, int], float]:
        """(depth, rank among siblings) -> the share of the draft model's judged nodes there that were kept."""
        return {key: self.accepted_by_depth_rank[key] / judged
                for key, judged in sorted(self.judged_by_depth_rank.items())}

    @property
    def verify_cost(self) -> dict[int, float]:
        """v(n): mean verify time over n new tokens divided by the mean time of a 1-token step (if measured)."""
        means = {n: sum(ts) / len(ts) for n, ts in self.verify_time_by_tokens.items() if ts}
        base = means.get(1)
        if not base:
            return {}
        return {n: means[n] / base for n in sorted(means)}

    @property
    def cost_ratio_c(self) -> float | None:
        step = self.verify_time_by_tokens.get(1)
        if not self.draft_forwards or not step:
            return None
        return (self.draft_time_s / self.draft_forwards) / (sum(step) / len(step))

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time_s if self.total_time_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["draft_length_hist"] = dict(sorted(self.draft_length_hist.items()))
        # the kinds' words as keys, plain strings for JSON (asdict would count a Counter's pairs)
        data["plain_reasons"] = {kind.value: count for kind, count in self.plain_reasons.most_common()}
        data["plain_wording"] = {kind.value: wording for kind, wording in self.plain_wording.items()}
        for name in ("judged_by_depth_rank", "accepted_by_depth_rank"):  # "depth/rank" keys: JSON has no tuples
            data[name] = {f"{depth}/{rank}": count for (depth, rank), count in sorted(getattr(self, name).items())}
        data["acceptance_by_depth_rank"] = {f"{depth}/{rank}": rate
                                            for (depth, rank), rate in self.acceptance_by_depth_rank.items()}
        data["verify_time_by_tokens"] = {
            n: sum(ts) / len(ts) for n, ts in sorted(self.verify_time_by_tokens.items()) if ts
        }
        for name in ("mean_accepted_length", "tokens_per_forward", "acceptance_rate", "acceptance_per_position",
                     "verify_cost", "cost_ratio_c", "tokens_per_s"):
            data[name] = getattr(self, name)
        return data

    def why_plain(self) -> str:
        """Why rounds were plain, most frequent first, with the newest wording of each: "14 rounds: draft
        prompt read not repaid: 0.90 s to read, ~0.70 s saved over the 12 tokens left"."""
        return "; ".join(f"{count} round{'s' if count > 1 else ''}: {self.plain_wording[kind]}"
                         for kind, count in self.plain_reasons.most_common())

    def explain(self) -> list[str]:
        """Where the call's time went, why rounds were plain and where its first estimates came from, one line
        each (``hf-specdec generate -v``, the demo)."""
        lines = [f"time: prefill {self.prefill_time_s:.2f} s, verify {self.verify_time_s:.2f} s over {self.forwards} "
                 f"forwards, draft {self.draft_time_s:.2f} s over {self.draft_forwards} draft steps, draft prompt "
                 f"read {self.draft_setup_time_s:.2f} s, total {self.total_time_s:.2f} s"]
        lines += [f"plain: {count} round{'s' if count > 1 else ''}: {self.plain_wording[kind]}"
                  for kind, count in self.plain_reasons.most_common()]
        if self.fell_back:
            lines.append(f"fell back to plain decoding: {self.fell_back}")
        if self.estimates_from is not None:
            priors = self.estimates_from is EstimatesFrom.PRIORS
            lines.append(f"first estimates: {f'priors ({self.estimates_why})' if priors else self.estimates_why}")
        return lines

    def summary(self) -> str:
        c = self.cost_ratio_c
        text = (
            f"{self.new_tokens} tokens in {self.rounds} rounds ({self.tokens_per_s:.2f} tok/s), "
            f"mean accepted length {self.mean_accepted_length:.2f}, acceptance {self.acceptance_rate:.0%}, "
            f"c={'n/a' if c is None else f'{c:.2f}'}, rounds with speculation off {self.rounds_spec_off}"
        )
        if self.estimates_from is not None:
            text += f", first estimates: {self.estimates_from}"
        if self.tree_rounds:
            text += f", {self.tree_rounds} tree rounds ({self.tree_nodes / self.tree_rounds:.1f} nodes verified each)"
        return f"{text} ({self.why_plain()})" if self.plain_reasons else text


# How ``combined`` joins each field of two calls' stats; every other field is a count or seconds, and adds up.
_FIRST = ("mode", "ttft_s", "estimates_from", "estimates_why")  # the first call's (ttft: the first token's)
_LARGEST = ("rows", "cache_bytes", "draft_cache_bytes")
_LATEST = ("fell_back", "guess_cap")  # the latest call's that has one
_PER_POSITION = ("drafted_per_position", "accepted_per_position")


def combined(parts: Sequence[SpecStats]) -> SpecStats:
    """The stats of hf_specdec calls made for one ``generate`` call, as one: Whisper's long-form transcription
    calls ``GenerationMixin.generate`` once per window (and per temperature-fallback rerun), each an hf_specdec
    call of its own. Counts and seconds add up, per-position counts add up position by position, logs follow each
    other; the first token's time and the first estimates are the first call's, sizes the largest.

    >>> a, b = SpecStats(new_tokens=5, rounds=3, accepted=2), SpecStats(new_tokens=4, rounds=2, accepted=1)
    >>> a.accepted_per_position, b.accepted_per_position = [2, 1], [1]
    >>> both = combined([a, b])
    >>> both.new_tokens, both.rounds, both.accepted, both.accepted_per_position
    (9, 5, 3, [3, 1])
    """
    whole = dataclasses.replace(parts[0])
    for part in parts[1:]:
        joined = {}
        for spec in dataclasses.fields(SpecStats):
            name, mine, theirs = spec.name, getattr(whole, spec.name), getattr(part, spec.name)
            if name in _FIRST:
                joined[name] = mine if mine is not None else theirs
            elif name in _LARGEST:
                joined[name] = max(mine, theirs)
            elif name in _LATEST:
                joined[name] = theirs if theirs is not None else mine
            elif name in _PER_POSITION:
                longest = max(len(mine), len(theirs))
                joined[name] = [(mine[i] if i < len(mine) else 0) + (theirs[i] if i < len(theirs) else 0)
                                for i in range(longest)]
            elif isinstance(mine, Counter):
                joined[name] = mine + theirs
            elif isinstance(mine, list):
                joined[name] = mine + theirs
            elif name == "verify_time_by_tokens":
                joined[name] = {n: mine.get(n, []) + theirs.get(n, []) for n in {*mine, *theirs}}
            elif isinstance(mine, dict):  # plain_wording: each kind's newest
                joined[name] = {**mine, **theirs}
            else:
                joined[name] = mine + theirs
        whole = SpecStats(**joined)
    return whole


class LastSpecStats:
    """``model.last_spec_stats``: the ``SpecStats`` of the calling thread's latest hf_specdec call on the model.

    Threads share a model (its weights, ``generate``) but each reads its own latest call's stats: attribute reads
    go to them (``model.last_spec_stats.summary()``, ``.drafted``), ``get()`` returns them (None before a call on
    this thread finished, or after one that raised), and it is false when there are none. Each call resets the
    calling thread's entry when it starts. ``out.spec_stats`` (``return_dict_in_generate=True``) is the call's
    own, whatever the thread.

    A ``generate`` call of ``enable``'s opens a *call* (``opened``): the hf_specdec calls made inside it (Whisper's
    long-form windows, each one ``GenerationMixin.generate`` call) are ``combined`` into that call's stats.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self) -> SpecStats | None:
        return getattr(self._local, "stats", None)

    def set(self, stats: SpecStats | None) -> None:
        """An hf_specdec call's stats (None: one starts). Inside an open call, each one's stats join the call's
        (``combined``), and a start clears nothing."""
        depth = getattr(self._local, "depth", 0)
        if depth and stats is None:
            return
        earlier = self.get() if depth else None
        self._local.stats = stats if earlier is None else combined([earlier, stats])

    @contextlib.contextmanager
    def opened(self):
        """One ``generate`` call that may make several hf_specdec calls: its stats start empty, join theirs, and
        are none if it raises."""
        depth = getattr(self._local, "depth", 0)
        if not depth:
            self._local.stats = None
        self._local.depth = depth + 1
        try:
            yield self
        except BaseException:
            self._local.stats = None
            raise
        finally:
            self._local.depth = depth

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_local":  # copy/pickle probes, and before __init__ ran
            raise AttributeError(name)
        stats = self.get()
        if stats is None:
            raise AttributeError(f"last_spec_stats.{name}: no hf_specdec call on this model has finished on this "
                                 "thread (or its latest one raised); check `if model.last_spec_stats:` or use "
                                 "model.last_spec_stats.get() first.")
        return getattr(stats, name)

    def __bool__(self) -> bool:
        return self.get() is not None

    def __reduce__(self):  # a copied or pickled model starts with no stats: they belong to calls on the original
        return (LastSpecStats, ())

    def __deepcopy__(self, memo) -> LastSpecStats:
        return LastSpecStats()

    def __repr__(self) -> str:
        return f"LastSpecStats({self.get()!r})"


def last_spec_stats(model) -> SpecStats | None:
    """The calling thread's latest hf_specdec stats on ``model`` (None if none, or if that call raised)."""
    holder = getattr(model, "last_spec_stats", None)
    return holder.get() if isinstance(holder, LastSpecStats) else holder


def stats_holder(model) -> LastSpecStats:
    """``model.last_spec_stats``, made on first use (``enable`` makes it; a callable used without ``enable`` makes
    it on its first call)."""
    holder = model.__dict__.get("last_spec_stats")
    if not isinstance(holder, LastSpecStats):
        holder = LastSpecStats()
        model.__dict__["last_spec_stats"] = holder
    return holder
