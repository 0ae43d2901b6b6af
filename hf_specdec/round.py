"""The one shape of a round: what is offered, what is planned, what is proposed, what came of it.

A round is one target forward (see ``verify.py`` for the terms). It passes through four values, in order:

``Offer``         what a drafter could propose without running a model: ready-made candidates (prompt lookup,
                  the lookahead pool, recycled choices) and how many tokens its draft model could add;
``RoundPlan``     every size of the round, chosen by the policy from the offer and the measured costs;
``Proposal``      the guesses to verify: a trie of tokens (a chain is a trie with one path), where each token
                  came from, the distributions sampled ones were drawn from, and any extra inputs the drafter
                  wants the target to read (the Jacobi window);
``RoundOutcome``  what the target kept and what the round cost, handed unchanged to the stats, the policy and
                  the drafter, so that all three learn from the same facts.

Worked example: a draft model drafts two tokens and prompt lookup appends one; the chain is a trie with one
path, ``tokens=(7, 8, 9)``, ``parents=(-1, 0, 1)``, ``sources`` one per token
(``Source(DRAFT, 0, 1)``, ``Source(DRAFT, 0, 2)``, ``Source(LOOKUP, 0, 1)``). If the target keeps 7 and 8
and then wants 4, the outcome has ``accepted=(0, 1)`` (node ids) and ``next_token=4``: the round emitted 7, 8, 4.

Every guess names its source by a ``SourceKind``: the planner learns acceptance per (kind, variant, depth), the
stats count what the draft model proposed apart from what lookups proposed, and a kind that is not one of these
cannot exist.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple, Protocol, Sequence

import torch


@dataclass(frozen=True)
class RowView:
    """One row of the batch as drafters and policies see it: ``row``, its index in the caller's batch; ``ids``:
    [L] its committed tokens without padding (prompt + emitted); ``budget``: the most tokens its next proposal
    may hold (the room left before the length limit)."""

    row: int
    ids: torch.Tensor
    budget: int


class SourceKind(enum.StrEnum):
    """Where a guess came from (its acceptance is learned by kind and variant; see ``Source``)."""

    DRAFT = "draft"  # the draft model
    LOOKUP = "lookup"  # prompt lookup after (or instead of) the draft model's tokens
    HISTORY = "history"  # lookahead: prompt lookup in this call's text, the first continuation found
    MEMORY = "memory"  # lookahead: prompt lookup in earlier calls' text (``LookaheadMemory``)
    HISTORY_ALT = "history_alt"  # the other continuations the same lookup found (at most one can be right)
    MEMORY_ALT = "memory_alt"
    POOL = "pool"  # the Jacobi window's n-gram pool
    RECYCLE = "recycle"  # the target's own earlier top choices (Token Recycling), by rank
    RECYCLE_SECOND = "recycle_second"  # its second choices after the first one, by rank

    @property
    def model_drafted(self) -> bool:
        """Did a draft model produce it (else a lookup of text or earlier choices, which costs no forward)?"""
        return self is SourceKind.DRAFT

    def alternative(self) -> "SourceKind":
        """The kind of a lookup's other continuations (``HISTORY`` -> ``HISTORY_ALT``)."""
        return {SourceKind.HISTORY: SourceKind.HISTORY_ALT, SourceKind.MEMORY: SourceKind.MEMORY_ALT}[self]


# Prior acceptance of each source's first guesses, per variant (Beta prior; the planner learns from it). A variant
# past a kind's last takes its last (a longer match, a lower rank). Every kind has one: ``prior_acceptance`` never
# guesses. Alternatives to a lookup's first continuation are learned apart: at most one of them can be right, and
# counting them as likely as the first would credit a trie of many alternatives with more tokens than it can give.
PRIOR_ACCEPTANCE = MappingProxyType({
    # Beta(2, 1): a draft of the same family agrees more often than not; by rank among siblings (a tree's second
    # choice is judged when its parent was kept, and kept only if the first choice was not)
    SourceKind.DRAFT: (2 / 3, 0.15, 0.06, 0.03),
    SourceKind.LOOKUP: (0.5,),
    SourceKind.POOL: (0.25,),
    SourceKind.HISTORY: (0.3, 0.3, 0.45, 0.6, 0.7),  # by the length of the match (variant 0 unused)
    SourceKind.MEMORY: (0.15, 0.15, 0.3, 0.45, 0.55),
    SourceKind.HISTORY_ALT: (0.1, 0.1, 0.15, 0.2, 0.25),
    SourceKind.MEMORY_ALT: (0.05, 0.05, 0.1, 0.15, 0.2),
    SourceKind.RECYCLE: (0.3, 0.1, 0.05, 0.03),  # by rank
    SourceKind.RECYCLE_SECOND: (0.1, 0.05, 0.03),
})

# How many observations each prior counts as (its Beta pseudo-counts): the draft model's 2/3 is Beta(2, 1), a
# belief about a whole model's agreement; every other prior is Beta(p, 1 - p) scaled to 2, a guess the first
# rounds overrule.
PRIOR_WEIGHT = MappingProxyType({kind: 3.0 if kind is SourceKind.DRAFT else 2.0 for kind in SourceKind})


def prior_acceptance(key: tuple[SourceKind, int]) -> float:
    """The prior of a source ``(kind, variant)``.

    >>> prior_acceptance((SourceKind.HISTORY, 2)), prior_acceptance((SourceKind.HISTORY, 9))
    (0.45, 0.7)
    """
    kind, variant = key
    table = PRIOR_ACCEPTANCE[SourceKind(kind)]
    return table[min(variant, len(table) - 1)]


class RoundKind(enum.StrEnum):
    """What a round runs, as far as its host work goes (``costmodel.RoundCost.host``): each kind has its own
    planning, layout and keep around the forwards (a tree is planned by a search over shapes and kept by a gather;
    a chain, by a count and a crop), learned apart."""

    PLAIN = "plain"  # no guess: one forward over the last token
    CHAIN = "chain"  # the draft model's chain (with or without a prompt-lookup tail)
    TREE = "tree"  # the draft model's tree
    TRIE = "trie"  # ready-made candidates (prompt lookup, the lookahead pool) and a Jacobi window, no draft model

    @property
    def within(self) -> "RoundKind | None":
        """The kind whose host work a round of this kind does too (a tree is planned and kept as a chain is, and
        more; a chain or a trie does what a plain step does, and more): what prices it before it was measured."""
        return {RoundKind.TREE: RoundKind.CHAIN, RoundKind.CHAIN: RoundKind.PLAIN,
                RoundKind.TRIE: RoundKind.PLAIN}.get(self)

    @classmethod
    def of(cls, plans: Sequence["RoundPlan"]) -> "RoundKind":
        """The kind of a round whose rows follow ``plans``: the most involved any row runs.

        >>> RoundKind.of([RoundPlan(model_tokens=3), RoundPlan()]), RoundKind.of([RoundPlan(window=(2, 3))])
        (<RoundKind.CHAIN: 'chain'>, <RoundKind.TRIE: 'trie'>)
        """
        if any(plan.tree is not None for plan in plans):
            return cls.TREE
        if any(plan.model_tokens for plan in plans):
            return cls.CHAIN
        return cls.PLAIN if all(plan.is_plain for plan in plans) else cls.TRIE


class PlainReason(enum.StrEnum):
    """Why a planner chose a plain round (``PlainWhy.kind``): the stats count plain rounds by it. Each value is the
    first words of the wording a user reads ("<kind>: <this round's numbers>")."""

    FIRST_STEP = "a plain step first"  # nothing measured at this batch size yet: t(1), the reference of every size
    NO_ROOM = "no room left"  # one token left: the round's own, nothing to guess
    READ_NOT_REPAID = "draft prompt read not repaid"  # the tokens left cannot repay the draft reading the prompts
    DOES_NOT_PAY = "drafting does not pay"  # the draft's best round is expected slower than a plain step
    NO_GUESS = "no guess worth its cost"  # nothing offered (or affordable) beats a plain step


@dataclass(frozen=True)
class PlainWhy:
    """Why a round is plain: its ``kind`` (what the stats count and the policy tests) and this round's ``detail``
    (its numbers, for people). Its text is the wording users read.

    >>> str(PlainWhy(PlainReason.NO_ROOM, "the length limit")), str(PlainWhy(PlainReason.NO_GUESS))
    ('no room left: the length limit', 'no guess worth its cost')
    """

    kind: PlainReason
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}" if self.detail else str(self.kind)


class Source(NamedTuple):
    """Where a guess came from, which is what its acceptance is learned by.

    kind: a ``SourceKind``.
    variant: how much context matched (lookups), the rank of a recycled choice, the rank of a draft-model token
        among its siblings in a tree (0: the draft's first choice, the only one of a chain), else 0.
    position: 1-based position of the token within the candidate that offered it (a tree node's depth).
    """

    kind: SourceKind
    variant: int
    position: int

    @property
    def key(self) -> tuple[SourceKind, int]:
        return self.kind, self.variant


class Candidate(NamedTuple):
    """A ready-made continuation of the committed tokens, with where it came from (``source``: kind, variant)."""

    tokens: tuple[int, ...]
    source: tuple[SourceKind, int]


@dataclass(frozen=True)
class Offer:
    """What a drafter can propose this round without running a model, and what its model could add."""

    candidates: tuple[Candidate, ...] = ()
    model_tokens: int = 0  # most tokens the drafter's own model can draft (0: it has none)
    trees: bool = False  # its model can draft a tree (``RoundPlan.tree``), not only a chain
    setup_tokens: int = 0  # tokens its model must read before it first drafts (the prompt; 0 once read)
    positions_left: int | None = None  # positions after the last token before the model's position table ends
    one_path: bool = False  # the model reads no trie (``support.tree_refusal``): one path of the candidates, no window


class ChainRule(Protocol):
    """The in-round part of a plan for a draft model's chain: a value computed by the policy, read by the drafter."""

    def keep_drafting(self, confidences: Sequence[float]) -> bool:
        """After drafting tokens with these confidences, is one more worth its cost?"""

    def lookup_tokens(self, confidences: Sequence[float]) -> int:
        """How many prompt-lookup tokens may follow a chain drafted with these confidences."""


@dataclass(frozen=True)
class TreeShape:
    """The size of a draft model's tree for one round, chosen by the policy; the drafter grows it.

    nodes[d - 1]: nodes verified at depth d (d = 1..depth); expanded[d]: nodes of depth d the draft reads in its
    forward of depth d (depth 0: the last committed token, once a row), whose children are the candidates of depth
    d + 1; children: the most children of one node (the draft's top choices, or draws without replacement);
    rates[r][d - 1]: the acceptance the planner priced a node of rank r at depth d with (given its parent was
    kept), by which the drafter ranks its nodes, so that it grows the tree that was priced; None: by the draft's
    own cumulative probability.

    Worked example: ``TreeShape(nodes=(2, 2, 1), expanded=(1, 2, 1), children=2)``: one draft forward over the last
    token gives the two depth-1 nodes, one forward over both gives four candidates of which two are kept, one over
    the likelier of those gives the depth-3 node: 3 draft forwards of 1, 2 and 1 inputs, 5 nodes verified.

    >>> TreeShape(nodes=(2, 2, 1), expanded=(1, 2, 1), children=2).num_nodes
    5
    """

    nodes: tuple[int, ...]
    expanded: tuple[int, ...]
    children: int
    rates: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        assert len(self.expanded) == len(self.nodes), "one expanded count per depth"
        assert all(n <= e * self.children for n, e in zip(self.nodes, self.expanded)), "too few candidates"
        assert all(e <= n for e, n in zip(self.expanded[1:], self.nodes)), "expanded nodes must exist"

    @property
    def depth(self) -> int:
        return len(self.nodes)

    @property
    def num_nodes(self) -> int:
        return sum(self.nodes)

    @property
    def branches(self) -> bool:
        """Does some node have more than one child (else it is a chain)?"""
        return any(n > e for n, e in zip(self.nodes, self.expanded))


@dataclass(frozen=True)
class RoundPlan:
    """Every size of one round, decided by the policy (``policy.py``); the drafter follows it.

    model_tokens: most draft-model tokens (0: no draft forward).
    max_tokens: most tokens the whole proposal may hold (the room left before the length limit).
    rule: the in-round rule of the draft model's chain (``policy.ChainRule``): whether to draft one more token
        given the confidences so far, and how many prompt-lookup tokens may follow. None: draft exactly
        ``model_tokens``, no lookup tail.
    tree: the draft model grows a tree of this shape instead of a chain (``model_tokens`` is then its depth);
        None: a chain.
    candidates: the ready-made candidates (or prefixes of them) to verify, best first; their merged trie is the
        proposal when ``model_tokens`` is 0.
    window: (W, N) of the Jacobi window; (1, 2) is no window.
    probe: the round guesses although the estimates say it does not pay, to measure again (a bounded probe).
    offered: the drafter offered ready-made candidates to choose from (chosen or not).
    plain_why: for a plain round, why the planner chose it (``PlainWhy``: the stats count rounds by its kind);
        None otherwise. ``why`` is its wording ("" when None).
    """

    model_tokens: int = 0
    max_tokens: int = 0
    rule: ChainRule | None = None
    tree: TreeShape | None = None
    candidates: tuple[Candidate, ...] = ()
    window: tuple[int, int] = (1, 2)
    probe: bool = False
    offered: bool = False
    plain_why: PlainWhy | None = None

    @property
    def why(self) -> str:
        """Why the round is plain, as users read it ("<kind>: <this round's numbers>"; "" for a round that guesses)."""
        return "" if self.plain_why is None else str(self.plain_why)

    @property
    def is_plain(self) -> bool:
        return self.model_tokens == 0 and not self.candidates and self.window == (1, 2)


@dataclass(frozen=True)
class ExtraInputs:
    """Inputs the target reads in the same forward but nobody verifies: the Jacobi window (``layout.py``).

    token_ids: [w] the inputs, after the last committed token; offsets: [w] their positions after the last
    token's (>= 1); mask: [w, w] bool, which extra inputs each extra input sees (they all see the last token and
    the cache, never the trie); read: [r] the inputs whose next-token choice the drafter wants (0: the last
    token, i: ``token_ids[i - 1]``).
    """

    token_ids: torch.Tensor
    offsets: torch.Tensor
    mask: torch.Tensor
    read: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True)
class Proposal:
    """The guesses of one round, as a trie: node ids follow insertion order, so a parent precedes its children.

    tokens[i]: token of node i; parents[i]: its parent node, -1 for children of the last committed token;
    sources[i]: every candidate that offered node i (a node shared by two candidates is judged for both);
    draft_probs: [n, V] the distribution each token was sampled from (one-hot rows for deterministic tokens);
        None when every token is deterministic (greedy drafts, lookups);
    confidences: the draft model's own probability of each token it drafted, in order (policies calibrate it);
    extra: inputs the drafter wants read but not verified (the Jacobi window), or None;
    top_k: how many of the target's top choices after each computed row the drafter wants back (0: none);
    draft_time / draft_forwards: seconds spent proposing and draft-model forwards run (the per-round cost);
    draft_steps: (inputs per row, seconds) of each draft-model forward, where they are not one input each (a tree's
    forwards read its frontier); empty: each of the ``draft_forwards`` read one input per row;
    setup_time / setup_tokens: one-off seconds before it and the tokens read in them (the draft model reading the
    prompts the first time it is used; the tokens of the left-padded batch, padding included);
    device_tokens: [n] a chain's tokens while they are still where the draft model computed them (a greedy draft
    whose plan reads no confidences): ``tokens`` is then empty, and the loop reads them with the target's choices,
    in the round's one device-to-host transfer (``resolved``); None: ``tokens`` holds them.
    """

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    sources: tuple[tuple[Source, ...], ...] = ()
    draft_probs: torch.Tensor | None = None
    confidences: tuple[float, ...] = ()
    extra: ExtraInputs | None = None
    top_k: int = 0
    draft_time: float = 0.0
    draft_forwards: int = 0
    draft_steps: tuple[tuple[int, float], ...] = ()
    setup_time: float = 0.0
    setup_tokens: int = 0
    device_tokens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = len(self.parents)
        assert len(self.sources) == n, "tokens, parents and sources must align"
        assert len(self.tokens) == n if self.device_tokens is None else (
            not self.tokens and self.device_tokens.shape == (n,)), "tokens, parents and sources must align"
        assert all(-1 <= p < i for i, p in enumerate(self.parents)), "a parent must precede its child"
        assert self.draft_probs is None or self.draft_probs.shape[0] == n, "draft_probs must be [n, V]"

    @classmethod
    def chain(cls, tokens, sources, draft_probs=None, **fields) -> "Proposal":
        """A single path: each token the child of the one before."""
        tokens = tuple(int(t) for t in tokens)
        return cls(tokens=tokens, parents=tuple(range(-1, len(tokens) - 1)),
                   sources=tuple((s,) for s in sources), draft_probs=draft_probs, **fields)

    @classmethod
    def device_chain(cls, token_ids: torch.Tensor, sources, **fields) -> "Proposal":
        """A single path whose tokens [n] are still on the device (``device_tokens``)."""
        n = int(token_ids.shape[0])
        return cls(parents=tuple(range(-1, n - 1)), sources=tuple((s,) for s in sources), device_tokens=token_ids,
                   **fields)

    def resolved(self, tokens: Sequence[int]) -> "Proposal":
        """The same proposal with its ``device_tokens`` read: ``tokens`` (the loop's one transfer of the round)."""
        return dataclasses.replace(self, tokens=tuple(tokens), device_tokens=None)

    @property
    def num_tokens(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> tuple[int, ...]:
        """1 for the children of the last committed token."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    @property
    def depth(self) -> int:
        """The longest path: the round's "draft length"."""
        return max(self.depths, default=0)

    @property
    def branches(self) -> bool:
        """Does some node (or the last committed token) have more than one child?"""
        return self.paths > 1

    @property
    def paths(self) -> int:
        """Leaves of the trie: 0 for no guesses, 1 for a chain, more for a tree (e.g. parents (-1, 0, 0): 2)."""
        return len(self.parents) - len(set(self.parents) - {-1})

    def path(self, node: int) -> list[int]:
        """Node ids from the root's child down to ``node``."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]


@dataclass(frozen=True)
class RoundOutcome:
    """What came of one round, as every party sees it.

    accepted: node ids of the accepted path (root's child first); next_token: the recovered or bonus token;
    emitted: the tokens the round committed, cut at the first stop (so possibly fewer than the path + 1);
    start_length: the sequence length before the round (the last committed token is at start_length - 1);
    forward_tokens: inputs of the target forward (its
    cost is learned by this count); verify_time: seconds of forward + processing + verification;
    extra_next: [r] the target's choice after each read extra input; top_inputs: [R] the inputs whose top
    choices were computed (the last token, the nodes, the read extras) and top_next: [R, K] those choices
    (both None unless the proposal asked for ``top_k``); row: the row's index in the caller's batch; finished:
    the row stopped this round (EOS, a stop string, a criterion or the length limit); rows: rows in the forward;
    plan: the plan the round followed; compacted, compact_time: the holes (row x column cells) the cache's
    compaction removed after this round's keep and its seconds (0 when it did not run): a step of its own, not
    part of ``verify_time``, priced per hole (``costmodel.RoundCost.hole``).
    """

    proposal: Proposal
    accepted: tuple[int, ...]
    next_token: int
    emitted: tuple[int, ...]
    start_length: int
    forward_tokens: int
    verify_time: float
    extra_next: torch.Tensor | None = None
    top_inputs: torch.Tensor | None = None
    top_next: torch.Tensor | None = None
    row: int = 0
    finished: bool = False
    rows: int = 1
    plan: RoundPlan = RoundPlan()
    compacted: int = 0
    compact_time: float = 0.0
    host_time: float = 0.0

    @classmethod
    def discarded(cls, view: RowView, proposal: Proposal, rows: int = 1) -> "RoundOutcome":
        """A round whose forward failed (out of memory) and is redone: nothing accepted, nothing emitted, so a
        drafter that already ran ahead (its draft cache) comes back to the committed tokens."""
        return cls(proposal, accepted=(), next_token=-1, emitted=(), start_length=int(view.ids.shape[0]),
                   forward_tokens=0, verify_time=0.0, row=view.row, rows=rows)

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)

    def judged(self) -> list[bool]:
        """Per node: did the target judge it, i.e. was its parent (or the last committed token) accepted?"""
        on_path = set(self.accepted)
        return [parent < 0 or parent in on_path for parent in self.proposal.parents]
