"""Batch > 1: every row of a left-padded batch gets exactly what plain batched generate gives it (fp32, greedy),
rows stop on their own, and sampling keeps each row's distribution.

The published pitfalls of batched speculation (arXiv 2510.22876: position ids, masks and cache drifting apart,
showing up as repeated tokens or garbage) are what these compare against: any drift changes a row's tokens.
"""

import pytest
import torch
from scipy.stats import chisquare

import hf_specdec
from tests.clock import VirtualClock
from tests.conftest import perturbed_copy, tiny_model

NEW = 24
PROMPTS = [[5, 17, 42, 8, 23, 61, 2, 9], [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4], [11, 12], [40, 41, 42, 43, 44],
           [9, 9, 9], [60, 2, 60, 2, 60, 2, 60], [7], [21, 22, 23, 24, 25, 26]]
PAD = 0


def left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def plain(model, ids, mask, **kwargs):
    return type(model).generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                pad_token_id=PAD, **kwargs)


def speculative(model, draft, ids, mask, policy="adaptive", **kwargs):
    return model.generate(ids, attention_mask=mask, custom_generate=hf_specdec.speculative_generate, draft_model=draft,
                          spec_config=hf_specdec.SpecConfig(policy=policy), max_new_tokens=NEW, do_sample=False,
                          pad_token_id=PAD, **kwargs)


def lookahead(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, custom_generate=hf_specdec.lookahead_generate,
                          max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **kwargs)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0)


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("draft", ["same", "random", "close"])
def test_batched_speculative_equals_plain_batched_generate(model, rows, draft):
    ids, mask = left_padded(PROMPTS[:rows])
    drafter = {"same": model, "random": tiny_model("llama", seed=1), "close": perturbed_copy(model, 0.02)}[draft]
    expected = plain(model, ids, mask)
    for policy in ("adaptive", "fixed"):  # the stats below are the fixed policy's: it always drafts
        memory = hf_specdec.SpeculativeMemory()  # injected costs: drafting pays, so adaptive drafts too
        memory.seed(drafter, forward_seconds={n: 1.0 for n in range(1, 17)}, draft_step_seconds=0.01)
        out = speculative(model, drafter, ids, mask, policy=policy, speculative_memory=memory)
        assert torch.equal(out, expected), (policy, out, expected)
        assert model.last_spec_stats.drafted > 0, policy
    stats = model.last_spec_stats.get()
    assert stats.rows == rows and stats.new_tokens == rows * NEW
    if draft == "same":
        assert stats.accepted > 0 and stats.forwards < NEW  # rows accepted several tokens per forward
    if draft == "close":
        assert 0 < stats.accepted < stats.drafted  # partial acceptance, rows accepting different counts


@pytest.mark.parametrize("rows", [2, 4, 8])
def test_batched_lookahead_equals_plain_batched_generate(model, rows, monkeypatch):
    ids, mask = left_padded(PROMPTS[:rows])
    expected = plain(model, ids, mask)
    clock = VirtualClock(monkeypatch)  # injected flat costs: guessing pays on any machine, and the auto sizing runs
    clock.charge(monkeypatch, model, lambda n: 1.0)
    memory = hf_specdec.LookaheadMemory()
    for _ in range(2):  # the second call starts from the first one's text: tries from the first round on
        assert torch.equal(lookahead(model, ids, mask, lookahead_memory=memory), expected)
        assert model.last_spec_stats.drafted > 0
    # an explicit shape verifies candidates every round, whatever this CPU's costs (auto sizing decides by them)
    explicit = hf_specdec.LookaheadConfig(window=3, ngram=3, max_candidates=2)
    assert torch.equal(lookahead(model, ids, mask, lookahead_memory=memory, lookahead_config=explicit), expected)
    assert model.last_spec_stats.accepted > 0


def test_rows_stop_at_their_own_eos_and_are_padded_as_plain_generate_pads(model):
    ids, mask = left_padded(PROMPTS[:4])
    free = plain(model, ids, mask)
    eos = int(free[0, ids.shape[1] + 5])  # row 0 stops early; the others at this token or at the length limit
    expected = plain(model, ids, mask, eos_token_id=eos)
    lengths = (expected[:, ids.shape[1]:] != PAD).sum(-1)
    assert len(set(lengths.tolist())) > 1, "the rows must stop at different times for this test to mean anything"
    assert torch.equal(speculative(model, model, ids, mask, eos_token_id=eos), expected)
    assert torch.equal(speculative(model, perturbed_copy(model, 0.02), ids, mask, eos_token_id=eos), expected)
    assert torch.equal(lookahead(model, ids, mask, eos_token_id=eos), expected)


def test_each_row_matches_its_own_unpadded_run(model):
    """Padding changes nothing but float rounding: each row equals the prompt generated alone (fp32)."""
    ids, mask = left_padded(PROMPTS[:4])
    out = speculative(model, perturbed_copy(model, 0.02), ids, mask)
    for row, prompt in enumerate(PROMPTS[:4]):
        alone = plain(model, torch.tensor([prompt]), None)
        assert out[row, ids.shape[1]:].tolist() == alone[0, len(prompt):].tolist(), row


def test_streaming_and_scores_are_refused_for_a_batch(model):
    ids, mask = left_padded(PROMPTS[:2])

    class Streamer:
        def put(self, value):
            pass

        def end(self):
            pass

    with pytest.raises(ValueError, match="cannot stream them or return per-step scores"):
        model.generate(ids, attention_mask=mask, custom_generate=hf_specdec.speculative_generate, draft_model=model,
                       spec_streamer=Streamer(), max_new_tokens=4, pad_token_id=PAD)
    with pytest.raises(ValueError, match="cannot stream them or return per-step scores"):
        model.generate(ids, attention_mask=mask, custom_generate=hf_specdec.lookahead_generate, max_new_tokens=4,
                       pad_token_id=PAD, output_scores=True, return_dict_in_generate=True)


def test_batched_sampling_keeps_each_rows_distribution():
    """Three prompts, three rows each, sampled together at temperature 0.9, two new tokens each (so the bonus
    token counts), a draft that agrees only partly: each prompt's pairs follow its exact two-token distribution
    under the target (chi-square, alpha = 1e-3, 2400 draws per prompt; fixed seed). The same counts held against the draft's own
    distribution must be rejected: the test can tell the two apart."""
    vocab = 8
    target = tiny_model("llama", seed=3, vocab=vocab)
    draft = perturbed_copy(target, 0.3)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 1, 2]]
    copies = 3
    ids, mask = left_padded(prompts * copies)
    def pair_distribution(model, prompt):
        with torch.no_grad():
            first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / 0.9, -1)
            table = torch.zeros(vocab, vocab)
            for a in range(vocab):
                table[a] = first[a] * torch.softmax(model(torch.tensor([prompt + [a]])).logits[0, -1] / 0.9, -1)
        return table.flatten()

    exact = [pair_distribution(target, prompt) for prompt in prompts]
    wrong = [pair_distribution(draft, prompt) for prompt in prompts]
    counts = torch.zeros(len(prompts), vocab * vocab)
    torch.manual_seed(0)
    for _ in range(800):
        out = target.generate(ids, attention_mask=mask, custom_generate=hf_specdec.speculative_generate,
                              draft_model=draft, spec_config=hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=2),
                              do_sample=True, temperature=0.9, top_k=0, top_p=1.0, max_new_tokens=2,
                              pad_token_id=PAD)
        pairs = out[:, ids.shape[1]:]
        for copy in range(copies):
            rows = pairs[copy * len(prompts):(copy + 1) * len(prompts)]
            counts[torch.arange(len(prompts)), rows[:, 0] * vocab + rows[:, 1]] += 1
    def p_value(row, distribution):
        keep = distribution > 1e-6
        expected = distribution[keep] / distribution[keep].sum() * counts[row][keep].sum()
        if counts[row][~keep].sum():
            return 0.0
        return chisquare(counts[row][keep].numpy(), expected.numpy()).pvalue

    for row in range(len(prompts)):
        assert p_value(row, exact[row]) > 1e-3, row
    assert min(p_value(row, wrong[row]) for row in range(len(prompts))) < 1e-3
