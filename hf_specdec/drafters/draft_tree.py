"""A tree of the draft model's likely continuations, grown depth by depth (``RoundPlan.tree``).

Where a target forward over more tokens costs about what one costs, the width of one forward is better spent on
the draft's second choices where it is unsure than on ever deeper guesses where it is sure (EAGLE-2, Li et al.
2024; OPT-Tree, Wang et al. 2024). The policy sizes the tree (``round.TreeShape``: nodes per depth, the nodes the
draft reads per depth, children per node) from measured costs and the acceptance learned per (depth, rank among
siblings); this module grows one of that shape per row:

- depth 0: the draft's forward over the row's catch-up tokens (as a chain's first step) gives the distribution
  after the last committed token;
- depth d: the candidates are the children of the nodes read at depth d - 1, each scored by the product along its
  path of the acceptance the planner priced each node's (rank, depth) with (``TreeShape.rates``), so the tree grown
  is the tree priced (a draft's own probabilities can rank its nodes far from how the target keeps them: a draft
  that agrees with the target on every token while giving each token 5% would otherwise grow a bush of shallow
  siblings in place of the priced chain and a sibling); without rates, by its cumulative draft probability (the
  product of the draft's probabilities along its path); the ``expanded[d]`` best nodes of depth d are read in one
  batched draft forward, every node continuing its parent's path in the draft's cache
  (``cache.KVStore.forward(after=[B, n])``), which gives the distributions of the next depth.

Which tokens become children, and which nodes are verified:

- greedy (``do_sample=False``): a node's children are the draft's top choices after it; every candidate is kept
  until the tree is grown, then the ``num_nodes`` best by score are verified (a parent's score is
  never below its child's, ties go to the shallower, older node, so the best ones always form a tree). A node
  scoring no more than the ``num_nodes``-th best candidate so far is not read (none of its descendants could be
  verified), so where the draft is unsure the tree stays shallow and its forwards narrow or stop. The target
  walks its own argmax through it (``verify.verify_tree_greedy``): exact whatever the shape.
- sampling: a node's children are drawn from the draft's processed distribution q without replacement, each
  reported (``Proposal.draft_probs``) as the distribution it was drawn from: q with the earlier siblings removed,
  renormalised. That is what ``verify.verify_tree_sampled`` needs: child i is accepted with
  min(1, p_i(x) / q_i(x)), else p_{i+1} = norm(max(0, p_i - q_i)) (recursive rejection sampling; Jeon et al.
  2024, "Recursive Speculative Decoding"), and the emitted token follows p exactly for any q_i a child was
  really drawn from. A child's existence must not depend on its own value (else it was not drawn from q_i): the
  number of children of every node of depth d is fixed before any of them is drawn, from the scores of depth d
  and the draft's sorted probabilities (slot r of a node scores its score times the r-th largest probability
  of q, whatever token the draw gives), and nothing is pruned afterwards. Which nodes are read further may
  depend on the drawn values (it only shapes their descendants).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..round import Proposal, RoundPlan, Source, SourceKind, TreeShape


@dataclass
class GrownTree:
    """One row's tree while it grows (node ids in creation order: a parent before its children, siblings in rank
    order, consecutive).

    tokens / parents / ranks / depths: per node; scores: the product along its path of each node's weight (its
    ``rates`` entry where the shape has rates: the tree the planner priced; else the draft's probability, the
    cumulative draft probability); confidences: the draft's probability of the node's token after its parent;
    drawn_from: per node, the distribution it was drawn from (sampling only); slots: the draft-cache slot of every
    node the draft read; distributions: the processed draft distribution after every node the draft read (root:
    -1); rates: ``TreeShape.rates``.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    drawn_from: list[torch.Tensor] = field(default_factory=list)
    slots: dict[int, int] = field(default_factory=dict)
    distributions: dict[int, torch.Tensor] = field(default_factory=dict)
    rates: tuple[tuple[float, ...], ...] | None = None

    def score(self, node: int) -> float:
        return 1.0 if node < 0 else self.scores[node]

    def weight(self, rank: int, depth: int, confidence: float) -> float:
        """What a node of this rank and depth whose token the draft gave ``confidence`` adds to its path's score."""
        if self.rates is None:
            return confidence
        return self.rates[rank][depth - 1] if rank < len(self.rates) and depth <= len(self.rates[rank]) else 0.0

    def add(self, parent: int, token: int, rank: int, confidence: float, drawn_from: torch.Tensor | None) -> None:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.ranks.append(rank)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(self.score(parent) * self.weight(rank, self.depths[-1], confidence))
        self.confidences.append(confidence)
        if drawn_from is not None:
            self.drawn_from.append(drawn_from)

    def at_depth(self, depth: int) -> list[int]:
        return [node for node, d in enumerate(self.depths) if d == depth]

    def best(self, nodes: Sequence[int], count: int) -> list[int]:
        """The ``count`` best of ``nodes`` by score (ties: shallower, then older), in creation order."""
        ranked = sorted(nodes, key=lambda node: (-self.scores[node], self.depths[node], node))
        return sorted(ranked[:count])

    def floor(self, count: int) -> float:
        """The ``count``-th best score so far (0 while there are fewer nodes): the final ``count`` best can only be
        better, so a node at or below it has no descendant among them (a child never scores above its parent)."""
        if len(self.scores) < count:
            return 0.0
        return sorted(self.scores, reverse=True)[count - 1]

    def path(self, node: int) -> list[int]:
        tokens = []
        while node >= 0:
            tokens.append(self.tokens[node])
            node = self.parents[node]
        return tokens[::-1]


def children_counts(tree: GrownTree, parents: Sequence[int], count: int, children: int) -> dict[int, int]:
    """How many children each of ``parents`` gets, ``count`` in all: the best slots by the parent's score times
    the r-th largest probability of its distribution (slot r), fixed before any child is drawn.

    >>> tree = GrownTree(distributions={-1: torch.tensor([0.6, 0.3, 0.1])})
    >>> children_counts(tree, [-1], 2, children=4)
    {-1: 2}
    >>> tree.add(-1, 0, 0, 0.6, None); tree.add(-1, 1, 1, 0.3, None)
    >>> tree.distributions.update({0: torch.tensor([0.5, 0.5, 0.0]), 1: torch.tensor([0.9, 0.1, 0.0])})
    >>> children_counts(tree, [0, 1], 3, children=4)  # slots 0.30, 0.30, 0.27, 0.03: two after 0, one after 1
    {0: 2, 1: 1}
    """
    slots = []
    for parent in parents:
        top = tree.distributions[parent].topk(min(children, tree.distributions[parent].shape[0])).values.tolist()
        depth = 1 if parent < 0 else tree.depths[parent] + 1
        slots += [(tree.score(parent) * tree.weight(rank, depth, p), rank, parent) for rank, p in enumerate(top)
                  if p > 0.0]
    chosen = sorted(slots, key=lambda slot: (-slot[0], slot[1], slot[2]))[:count]
    counts = {parent: 0 for parent in parents}
    for _, _, parent in chosen:
        counts[parent] += 1
    return counts


def draw_without_replacement(q: torch.Tensor, count: int) -> list[tuple[int, torch.Tensor]]:
    """``count`` tokens drawn one after another from q [V] without replacement, each with the distribution it was
    drawn from (q with the earlier draws removed, renormalised); fewer when q's support runs out."""
    draws, remaining = [], q.float().clone()
    for _ in range(count):
        total = float(remaining.sum())
        if total <= 0.0:
            break
        drawn_from = remaining / total
        token = int(torch.multinomial(drawn_from, 1))
        draws.append((token, drawn_from))
        remaining = remaining.clone()
        remaining[token] = 0.0
    return draws


def add_children(tree: GrownTree, parent: int, count: int, do_sample: bool) -> None:
    """The ``count`` children of ``parent`` (read by the draft): its top choices, or draws without replacement."""
    q = tree.distributions[parent]
    if do_sample:
        for rank, (token, drawn_from) in enumerate(draw_without_replacement(q, count)):
            tree.add(parent, token, rank, float(q[token]), drawn_from)
        return
    top = q.topk(min(count, q.shape[0]))
    for rank, (p, token) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
        if p > 0.0:
            tree.add(parent, token, rank, p, None)


# (rows' nodes to read: per row [(node, token, parent slot)]) -> per row: (slots [n], distributions [n, V])
ReadNodes = Callable[[list[list[tuple[int, int, int]]]], list[tuple[list[int], torch.Tensor]]]


def grow(trees: list[GrownTree], shapes: Sequence[TreeShape | None], root_slots: Sequence[int], read: ReadNodes,
         do_sample: bool) -> list[tuple[int, float]]:
    """Grow every row's tree to its shape, one batched draft forward (``read``) per depth after the first; each
    tree starts with its root distribution (``distributions[-1]``). Returns (inputs per row, seconds) of each
    forward run here. Greedy trees keep every candidate: ``verified`` picks the nodes to verify."""
    steps = []
    depth = max((shape.depth for shape in shapes if shape is not None), default=0)
    read_last = [[-1] for _ in trees]  # per row: the nodes read at the depth before
    for d in range(1, depth + 1):
        for tree, shape, parents in zip(trees, shapes, read_last):
            if shape is None or d > shape.depth:
                continue
            if do_sample:
                for parent, count in children_counts(tree, parents, shape.nodes[d - 1], shape.children).items():
                    add_children(tree, parent, count, do_sample=True)
            else:
                for parent in parents:
                    add_children(tree, parent, shape.children, do_sample=False)
        if d == depth:
            break
        start = time.perf_counter()
        reading = []
        for tree, shape in zip(trees, shapes):
            nodes = [] if shape is None or d >= shape.depth else tree.best(tree.at_depth(d), shape.expanded[d])
            if not do_sample:  # greedy: read no node whose descendants cannot make the verified ones
                floor = tree.floor(shape.num_nodes) if nodes else 0.0
                nodes = [node for node in nodes if tree.scores[node] > floor]
            reading.append(nodes)
        if not any(reading):
            break
        results = read([[(node, tree.tokens[node], tree.slots[tree.parents[node]] if tree.parents[node] >= 0
                          else root) for node in nodes]
                        for tree, nodes, root in zip(trees, reading, root_slots)])
        for tree, nodes, (slots, distributions) in zip(trees, reading, results):
            for node, slot, q in zip(nodes, slots, distributions):
                tree.slots[node], tree.distributions[node] = slot, q
        read_last = reading
        steps.append((max(map(len, reading)), time.perf_counter() - start))
    return steps


def verified(tree: GrownTree, shape: TreeShape, do_sample: bool) -> list[int]:
    """The nodes to verify, in creation order: every node drawn (sampling: counts fixed before drawing), or the
    ``num_nodes`` best by score (greedy; they form a tree, see the module docstring)."""
    nodes = list(range(len(tree.tokens)))
    return nodes if do_sample else tree.best(nodes, shape.num_nodes)


def proposal(tree: GrownTree, nodes: Sequence[int], **fields) -> tuple[Proposal, dict[int, int]]:
    """The proposal of ``nodes`` (a tree in creation order) and, per proposal node, the draft-cache slot of the
    nodes the draft read (what ``update`` keeps of the accepted path)."""
    index = {node: i for i, node in enumerate(nodes)}
    probs = torch.stack([tree.drawn_from[node] for node in nodes]) if tree.drawn_from and nodes else None
    built = Proposal(tokens=tuple(tree.tokens[node] for node in nodes),
                     parents=tuple(index[tree.parents[node]] if tree.parents[node] >= 0 else -1 for node in nodes),
                     sources=tuple((Source(SourceKind.DRAFT, tree.ranks[node], tree.depths[node]),) for node in nodes),
                     draft_probs=probs, confidences=tuple(tree.confidences[node] for node in nodes), **fields)
    return built, {index[node]: slot for node, slot in tree.slots.items() if node in index}


def row_shape(plan: RoundPlan) -> TreeShape | None:
    """The plan's tree cut to the depth the row may draft (``model_tokens``); None for no tree."""
    shape, depth = plan.tree, plan.model_tokens
    if shape is None or depth <= 0:
        return None
    if depth >= shape.depth:
        return shape
    return TreeShape(shape.nodes[:depth], shape.expanded[:depth], shape.children, shape.rates)
