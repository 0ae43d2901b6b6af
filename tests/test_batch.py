"""Batch > 1: every row of a left-padded batch gets exactly what plain batched generate gives it (fp32, greedy),
rows stop on their own, and sampling keeps each row's distribution.

The published pitfalls of batched speculation (arXiv 2510.22876: position ids, masks and cache drifting apart,
showing up as repeated tokens or garbage) are what these compare against: any drift changes a row's tokens.
"""

from collections import Counter

import pytest
import torch
from transformers import LogitsProcessorList

import hf_specdec
from hf_specdec.drafters.base import ChainDrafter, PerRow
from hf_specdec.drafters.draft_model import DraftModelDrafter
from hf_specdec.drafters.prompt_lookup import PromptLookupDrafter
from hf_specdec.round import SourceKind
from tests.clock import VirtualClock
from tests.conftest import VOCAB, perturbed_copy, tiny_model
from tests.test_sampling import ALPHA, p_value

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
    kwargs.setdefault("spec_config", hf_specdec.SpecConfig(policy=policy))
    return model.generate(ids, attention_mask=mask, custom_generate=hf_specdec.speculative_generate, draft_model=draft,
                          max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **kwargs)


FIXED = {"policy": "fixed", "num_draft_tokens": 4}  # drafts 4 tokens every round, whatever this machine's timings


class RowCounts:
    """A ``Drafter`` (drafters/base.py): the draft model's chain drafter with prompt lookup, as
    ``speculative_generate`` builds it for a greedy call, passed through; it counts per row of the batch the draft
    model's tokens drafted and kept (prompt lookup's left out, as ``SpecStats.lookup_drafted`` leaves them out)
    and the rounds whose accepted block a stop cut short."""

    def __init__(self, draft, rows: int):
        self.inner = ChainDrafter(DraftModelDrafter(draft, LogitsProcessorList(), do_sample=False, vocab_size=VOCAB,
                                                    pad_token_id=PAD), PerRow(PromptLookupDrafter))
        self.drafted, self.accepted, self.cut = [0] * rows, [0] * rows, [0] * rows

    def prefill(self, views):
        self.inner.prefill(views)

    def offer(self, views):
        return self.inner.offer(views)

    def propose(self, views, plans):
        return self.inner.propose(views, plans)

    def update(self, outcomes):
        for outcome in outcomes:
            by_model = [any(source.kind == SourceKind.DRAFT for source in sources)
                        for sources in outcome.proposal.sources]
            self.drafted[outcome.row] += sum(by_model)
            self.accepted[outcome.row] += sum(by_model[node] for node in outcome.accepted)
            self.cut[outcome.row] += len(outcome.emitted) < outcome.num_accepted + 1
        self.inner.update(outcomes)

    def cache_bytes(self):
        return self.inner.cache_bytes()

    def release(self):
        self.inner.release()


def by_draft_model(stats):
    """(drafted, accepted) of the call counting only the draft model's tokens, not prompt lookup's."""
    return stats.drafted - stats.lookup_drafted, stats.accepted - stats.lookup_accepted


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


def test_rows_stop_at_their_own_eos_and_are_padded_as_plain_generate_pads(model, monkeypatch):
    """The fixed policy drafts 4 tokens a round, so a row's EOS arrives inside an accepted block and must cut it;
    each row drafts and keeps the draft model's tokens (counted per row), not plain steps only."""
    ids, mask = left_padded(PROMPTS[:4])
    free = plain(model, ids, mask)
    eos = int(free[0, ids.shape[1] + 4])  # row 0 stops early; the others at this token or at the length limit
    expected = plain(model, ids, mask, eos_token_id=eos)
    lengths = (expected[:, ids.shape[1]:] != PAD).sum(-1)
    assert len(set(lengths.tolist())) > 1, "the rows must stop at different times for this test to mean anything"
    for draft in (model, perturbed_copy(model, 0.005)):
        assert torch.equal(speculative(model, draft, ids, mask, spec_config=FIXED, eos_token_id=eos), expected)
        drafted, accepted = by_draft_model(model.last_spec_stats.get())
        assert drafted > 0 and accepted > 0, (drafted, accepted)
        counts = RowCounts(draft, rows=4)
        assert torch.equal(speculative(model, counts, ids, mask, spec_config=FIXED, eos_token_id=eos), expected)
        assert all(counts.drafted) and all(counts.accepted), (counts.drafted, counts.accepted)
        assert counts.cut[0] == 1, counts.cut  # row 0's EOS (its 5th token) came inside an accepted block and cut it
    clock = VirtualClock(monkeypatch)  # injected flat costs: lookahead guesses on any machine
    clock.charge(monkeypatch, model, lambda n: 1.0)
    assert torch.equal(lookahead(model, ids, mask, eos_token_id=eos), expected)
    assert model.last_spec_stats.drafted > 0


def test_each_row_matches_its_own_unpadded_run(model):
    """Padding changes nothing but float rounding: each row equals the prompt generated alone (fp32), with the
    draft model's tokens drafted and kept in every row (the fixed policy drafts every round)."""
    ids, mask = left_padded(PROMPTS[:4])
    draft = perturbed_copy(model, 0.005)
    out = speculative(model, draft, ids, mask, spec_config=FIXED)
    drafted, accepted = by_draft_model(model.last_spec_stats.get())
    assert drafted > 0 and 0 < accepted < drafted, (drafted, accepted)
    counts = RowCounts(draft, rows=4)
    assert torch.equal(speculative(model, counts, ids, mask, spec_config=FIXED), out)
    assert all(counts.drafted) and all(counts.accepted), (counts.drafted, counts.accepted)
    for row, prompt in enumerate(PROMPTS[:4]):
        alone = plain(model, torch.tensor([prompt]), None)
        assert out[row, ids.shape[1]:].tolist() == alone[0, len(prompt):].tolist(), row


def test_streaming_is_refused_for_a_batch(model):
    ids, mask = left_padded(PROMPTS[:2])

    class Streamer:
        def put(self, value):
            pass

        def end(self):
            pass

    with pytest.raises(ValueError, match=r"so hf_specdec cannot stream them \(streamer=\)"):
        model.generate(ids, attention_mask=mask, custom_generate=hf_specdec.speculative_generate, draft_model=model,
                       spec_streamer=Streamer(), max_new_tokens=4, pad_token_id=PAD)


@pytest.mark.usefixtures("one_thread")  # 800 calls of tiny forwards: threads only wait for each other
def test_batched_sampling_keeps_each_rows_distribution():
    """Three prompts, three rows each, sampled together at temperature 0.9, two new tokens each (so the bonus
    token counts), a draft that agrees only partly: each prompt's pairs follow its exact two-token distribution
    under the target (chi-square, alpha = 1e-3, 2400 draws per prompt, cells expected below 5 draws pooled; fixed
    seed). The same counts held against the draft's own distribution must be rejected, for every prompt: the test
    can tell the two apart."""
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
    def p_of(row, distribution):  # tests/test_sampling.py's chi-square: cells expected below 5 draws pooled
        pairs = Counter({divmod(cell, vocab): int(n) for cell, n in enumerate(counts[row].tolist()) if n})
        return p_value(pairs, {divmod(cell, vocab): float(q) for cell, q in enumerate(distribution.tolist())})

    for row in range(len(prompts)):
        assert p_of(row, exact[row]) > ALPHA, row
        assert p_of(row, wrong[row]) < ALPHA, row  # every prompt's draws tell the target from the draft
