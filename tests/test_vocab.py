"""A draft with fewer (or more) vocabulary rows than the target: verification runs over the target's whole
vocabulary, the draft's probability is 0 in rows it lacks, and its rows past the target's are never proposed."""

import copy

import pytest
import torch
from transformers import LogitsProcessorList

import hf_specdec
from hf_specdec.drafters.draft_model import DraftModelDrafter
from hf_specdec.round import RoundPlan, RowView
from hf_specdec.verify import verify_tree_sampled
from tests.conftest import tiny_model

NEW = 40
PROMPT = torch.tensor([[5, 17, 42, 8, 23, 61, 2, 9]])


def resized(model, rows: int):
    """A copy of ``model`` with ``rows`` vocabulary rows: the same weights on the rows both have."""
    other = copy.deepcopy(model)
    other.resize_token_embeddings(rows, mean_resizing=False)
    return other


@pytest.fixture(scope="module")
def target():
    """A 128-row target whose greedy output goes through rows 124-127: row 126 is 1.2 x the row of its most
    frequent output token, so it wins wherever that token had a positive logit."""
    model = tiny_model("llama", seed=0, vocab=128, tie_word_embeddings=False)
    out = type(model).generate(model, PROMPT, max_new_tokens=NEW, do_sample=False)[0, PROMPT.shape[1]:]
    frequent = int(torch.bincount(out).argmax())
    with torch.no_grad():
        model.lm_head.weight[126] = 1.2 * model.lm_head.weight[frequent]
    return model


def plain(model, **kwargs):
    return type(model).generate(model, PROMPT, max_new_tokens=NEW, do_sample=False, **kwargs)


def fixed(draft, **kwargs):
    return dict(custom_generate=hf_specdec.speculative_generate, draft_model=draft,
                spec_config=hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=4, history_lookup=False), **kwargs)


@pytest.mark.parametrize("rows", [124, 132])
def test_greedy_parity_where_the_target_picks_a_row_the_draft_lacks(target, rows):
    expected = plain(target)
    assert (expected[0, PROMPT.shape[1]:] >= 124).any()  # the target emits rows past 124
    draft = resized(target, rows)
    if rows > 128:  # padding rows past the target's vocabulary that the draft would pick if they counted
        with torch.no_grad():
            draft.lm_head.weight[128:] = 10 * draft.lm_head.weight[:rows - 128]
    out = target.generate(PROMPT, max_new_tokens=NEW, do_sample=False, **fixed(draft))
    assert torch.equal(out, expected)
    stats = target.last_spec_stats.get()
    assert stats.drafted > 0 and stats.accepted > 0


def test_draft_probabilities_are_over_the_target_vocabulary_and_zero_where_it_has_no_row(target):
    draft = resized(target, 124)
    drafter = DraftModelDrafter(draft, LogitsProcessorList(), do_sample=True, vocab_size=128)
    view = RowView(0, torch.tensor([5, 17, 126, 8, 127, 61]), 6)  # ids the draft has no embedding for, read
    drafter.prefill([view])
    torch.manual_seed(0)
    (proposal,) = drafter.propose([view], [RoundPlan(model_tokens=4, max_tokens=4)])
    assert proposal.draft_probs.shape == (4, 128)
    assert float(proposal.draft_probs[:, 124:].abs().sum()) == 0.0
    assert torch.allclose(proposal.draft_probs.sum(-1), torch.ones(4))
    assert all(token < 124 for token in proposal.tokens)


def test_sampling_stays_the_target_distribution_with_a_smaller_draft():
    """x ~ q, where q (the draft's) is 0 on rows the draft lacks; the verified token must be distributed as p (the
    target's, with mass on those rows). Acceptance is exact by the uniform grid (u * q(x) <= p(x)), the recovered
    token is drawn from the residual: 4000 draws, within 3 standard errors of p on every row."""
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(8, generator=generator) * 2, -1) + torch.tensor([0.0] * 6 + [0.1] * 2)
    p = p / p.sum()
    q = torch.cat([torch.softmax(torch.randn(6, generator=generator), -1), torch.zeros(2)])
    draws = 4000
    torch.manual_seed(0)
    drafted = torch.multinomial(q, draws, replacement=True, generator=generator).tolist()
    counts = torch.zeros(8)
    for i, x in enumerate(drafted):
        u = torch.tensor([(i * 0.6180339887) % 1.0])  # equidistributed uniforms
        verdict = verify_tree_sampled((x,), (-1,), q[None], torch.stack([p, p]), uniforms=u)
        counts[x if verdict.accepted else verdict.next_token] += 1
    error = (p * (1 - p) / draws).sqrt()
    assert ((counts / draws - p).abs() <= 3 * error + 1e-3).all(), (counts / draws, p)
    assert counts[6:].sum() > 0.1 * draws  # rows the draft lacks are emitted
