"""The verifier alone: hand-built probabilities, no model."""

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from hf_specdec.verify import Verdict, chain, greedy_choice, verify_tree_greedy, verify_tree_sampled

V = 10


def verify_greedy(draft_ids, target_ids):
    """A chain: each draft token the child of the one before."""
    return verify_tree_greedy(draft_ids.tolist(), chain(len(draft_ids)), target_ids)


def verify_sampled(draft_ids, draft_probs, target_probs, uniforms=None, generator=None):
    if uniforms is None and generator is not None:
        uniforms = torch.rand(len(draft_ids), generator=generator)
    return verify_tree_sampled(draft_ids.tolist(), chain(len(draft_ids)), draft_probs, target_probs, uniforms)


def one_hot_logits(token_ids):
    """Logits whose argmax is each given token (vLLM's create_logits_tensor)."""
    logits = torch.zeros(len(token_ids), V)
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 10.0
    return logits


@pytest.mark.parametrize(
    "draft, target, expected",
    [
        ([1, 2, 3], [1, 2, 3, 4], Verdict((0, 1, 2), 4)),  # all accepted, bonus token 4
        ([1, 2, 3], [7, 2, 3, 4], Verdict((), 7)),  # first rejected, recovered token 7
        ([1, 2, 3], [1, 2, 9, 4], Verdict((0, 1), 9)),  # partial: two accepted, third replaced
        ([1, 5, 3], [1, 2, 3, 4], Verdict((0,), 2)),  # a later match after a mismatch does not count
        ([], [6], Verdict((), 6)),  # no draft: a plain step
    ],
)
def test_greedy_prefix_match(draft, target, expected):
    target_ids = one_hot_logits(target).argmax(-1)
    assert verify_greedy(torch.tensor(draft, dtype=torch.long), target_ids) == expected


def test_sampled_accepts_when_draft_equals_target():
    probs = torch.softmax(torch.randn(4, V), -1)
    draft_ids = torch.tensor([3, 1, 4])
    verdict = verify_sampled(draft_ids, probs[:3], probs, uniforms=torch.full((3,), 0.999))
    assert verdict.num_accepted == 3  # ratio is exactly 1 everywhere


def test_sampled_rejects_token_the_target_never_makes_and_recovers_from_residual():
    target_probs = torch.zeros(3, V)
    target_probs[:, 2] = 0.5
    target_probs[:, 7] = 0.5
    draft_probs = torch.zeros(2, V)
    draft_probs[:, 5] = 0.8
    draft_probs[:, 2] = 0.2
    for _ in range(50):
        verdict = verify_sampled(torch.tensor([5, 5]), draft_probs, target_probs)
        assert verdict.num_accepted == 0
        # residual = max(0, target - draft) = {2: 0.3, 7: 0.5}: only 2 or 7
        assert verdict.next_token in (2, 7)


def test_sampled_partial_acceptance_with_fixed_uniforms():
    target_probs = torch.full((4, V), 1.0 / V)
    draft_probs = torch.full((3, V), 1.0 / V)
    draft_probs[1] = 0.0
    draft_probs[1, 4] = 1.0  # draft was sure of token 4; target gives it 0.1 -> accept iff u <= 0.1
    verdict = verify_sampled(torch.tensor([1, 4, 2]), draft_probs, target_probs, uniforms=torch.tensor([0.5, 0.2, 0.1]))
    assert verdict.num_accepted == 1
    assert verdict.next_token != 4  # residual of row 1 has no mass on 4


def test_processed_distributions_temperature_and_top_k():
    """Verification runs on processed probabilities: a draft token outside the target's top-k is always rejected."""
    raw = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, -4.0]] * 2)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(3)])
    target_probs = torch.softmax(processors(torch.zeros(1, 1, dtype=torch.long), raw), -1)
    assert torch.all(target_probs[:, 3:] == 0)
    draft_probs = torch.full((1, V), 1.0 / V)
    for _ in range(30):
        verdict = verify_sampled(torch.tensor([6]), draft_probs, target_probs)
        assert verdict.num_accepted == 0 and verdict.next_token in (0, 1, 2)


def _total_variation(counts, probs):
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def _run_rounds(target_probs, draft_probs, sampled_from, n, seed):
    """Draw n rounds of k=2 draft tokens from ``sampled_from`` and verify them against ``draft_probs``."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.zeros(V)
    second = torch.zeros(V)
    for _ in range(n):
        draft_ids = torch.multinomial(sampled_from, 1, generator=generator)[:, 0]  # [2]
        verdict = verify_sampled(draft_ids, draft_probs, target_probs, generator=generator)
        out = draft_ids[: verdict.num_accepted].tolist() + [verdict.next_token]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


def test_speculative_sampling_reproduces_target_distribution():
    """20,000 rounds: the emitted tokens follow the target distribution (TV below 0.02 at both positions).

    The expected TV from sampling noise alone over 10 categories and 20k draws is about 0.01. The same test with
    a draft distribution other than the one the tokens were drawn from must fail (TV well above 0.05)."""
    generator = torch.Generator().manual_seed(0)
    target_probs = torch.softmax(torch.randn(3, V, generator=generator) * 1.5, -1)  # [k + 1, V]
    draft_probs = torch.softmax(torch.randn(2, V, generator=generator) * 1.5, -1)  # [k, V]
    first, second = _run_rounds(target_probs, draft_probs, draft_probs, 20_000, seed=1)
    assert _total_variation(first, target_probs[0]) < 0.02
    assert _total_variation(second, target_probs[1]) < 0.02

    # negative control: tokens drawn from a sharper distribution than the draft_probs handed to the verifier
    sharper = torch.softmax(torch.log(draft_probs) * 3, -1)
    wrong_first, _ = _run_rounds(target_probs, draft_probs, sharper, 20_000, seed=2)
    assert _total_variation(wrong_first, target_probs[0]) > 0.05


def test_deterministic_draft_is_lossless():
    """draft_probs=None (one-hot drafts, e.g. n-gram candidates) still yields the target distribution."""
    generator = torch.Generator().manual_seed(3)
    target_probs = torch.softmax(torch.randn(2, V, generator=generator), -1)
    counts = torch.zeros(V)
    for _ in range(20_000):
        verdict = verify_sampled(torch.tensor([4]), None, target_probs, generator=generator)
        counts[4 if verdict.num_accepted else verdict.next_token] += 1
    assert _total_variation(counts, target_probs[0]) < 0.02


# -- tries -------------------------------------------------------------------------------------------------------------
TRIE_TOKENS, TRIE_PARENTS = [7, 8, 9, 5, 3, 4], [-1, 0, 1, 1, -1, 4]  # 7 -> 8 -> {9, 5}; 3 -> 4


@pytest.mark.parametrize(
    "target, expected",
    [  # root 7  8  9  5  3  4: the target's choice after the last token, then after each node
        ([7, 8, 9, 0, 0, 0, 0], ((0, 1, 2), 0)),  # whole first candidate + bonus 0
        ([7, 8, 5, 0, 2, 0, 0], ((0, 1, 3), 2)),  # the sibling branch
        ([3, 0, 0, 0, 0, 4, 6], ((4, 5), 6)),  # second root child, to its leaf
        ([7, 1, 0, 0, 0, 0, 0], ((0,), 1)),  # recovered token after one accepted
        ([2, 0, 0, 0, 0, 0, 0], ((), 2)),
    ],
)
def test_greedy_walks_the_trie_along_the_targets_choices(target, expected):
    assert verify_tree_greedy(TRIE_TOKENS, TRIE_PARENTS, torch.tensor(target)) == expected
    assert verify_tree_greedy([], [], torch.tensor([11])) == ((), 11)


def _without(probs, token):
    """``probs`` [V] with ``token`` removed, renormalised: what a second sibling is drawn from."""
    rest = probs.clone()
    rest[token] = 0.0
    return rest / rest.sum()


def _run_tree_rounds(target_probs, draft_probs, n, seed, told=None):
    """Two distinct root children drawn from ``draft_probs[0]`` without replacement (the second from what is
    left), each with one child drawn from ``draft_probs[1]``; the verifier is told ``told`` (default: the truth)
    for the root children. Returns the counts of the first and second emitted tokens."""
    generator = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(n):
        a = int(torch.multinomial(draft_probs[0], 1, generator=generator))
        q_b = _without(draft_probs[0], a)
        b = int(torch.multinomial(q_b, 1, generator=generator))
        c, d = torch.multinomial(draft_probs[1], 2, replacement=True, generator=generator).tolist()
        tokens, parents = [a, b, c, d], [-1, -1, 0, 1]
        rows = torch.stack([draft_probs[0], q_b, draft_probs[1], draft_probs[1]])
        if told is not None:
            rows[:2] = told
        # target rows: after the last token, after each root child (one distribution), after each grandchild
        targets = target_probs[[0, 1, 1, 2, 2]]
        verdict = verify_tree_sampled(tokens, parents, rows, targets, torch.rand(4, generator=generator))
        out = [tokens[node] for node in verdict.accepted] + [verdict.next_token]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


def test_tree_sampling_reproduces_target_distribution():
    """Multi-draft rejection sampling over a trie (siblings drawn without replacement): the first and second
    emitted tokens follow the target (TV < 0.02 over 20,000 rounds; sampling noise alone is about 0.01); the
    negative control tells the verifier a flatter draft distribution than the siblings came from and must fail."""
    generator = torch.Generator().manual_seed(5)
    target_probs = torch.softmax(torch.randn(3, V, generator=generator) * 1.5, -1)
    draft_probs = torch.softmax(torch.randn(2, V, generator=generator) * 1.5, -1)
    first, second = _run_tree_rounds(target_probs, draft_probs, 20_000, seed=6)
    assert _total_variation(first, target_probs[0]) < 0.02
    assert _total_variation(second, target_probs[1]) < 0.02
    flatter = torch.softmax(torch.log(draft_probs[0]) * 0.3, -1)
    wrong, _ = _run_tree_rounds(target_probs, draft_probs, 20_000, seed=7, told=flatter)
    assert _total_variation(wrong, target_probs[0]) > 0.05


def test_deterministic_trie_is_lossless():
    """One-hot siblings (lookahead, prompt lookup): the first emitted token is a target sample."""
    generator = torch.Generator().manual_seed(8)
    target_probs = torch.softmax(torch.randn(1, V, generator=generator) * 2, -1).expand(4, V)
    counts = torch.zeros(V)
    for _ in range(20_000):
        verdict = verify_tree_sampled([1, 2, 3], [-1, -1, 0], None, target_probs, torch.rand(3, generator=generator))
        counts[[1, 2, 3][verdict.accepted[0]] if verdict.accepted else verdict.next_token] += 1
    assert _total_variation(counts, target_probs[0]) < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_choice_is_argmax_with_its_first_maximum_on_ties(dtype):
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (3, 5, 1000), generator=generator).to(dtype)  # many ties: values 0..3
    scores[0, 0, 10] = scores[0, 0, 20] = 9  # a tie for the maximum: the first one wins, as argmax picks it
    assert torch.equal(greedy_choice(scores), scores.argmax(dim=-1))
    assert int(greedy_choice(scores)[0, 0]) == 10
    assert greedy_choice(scores).dtype == torch.long and greedy_choice(scores).shape == (3, 5)
