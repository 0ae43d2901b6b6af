"""The logits processors plain ``generate`` builds for a batch, run by hf_specdec on a batch exactly as plain runs
them (``hf_specdec/processors.py``).

Some processors keep a value per batch row: ``repetition_penalty`` leaves each row's left padding out (its
``prompt_ignore_length`` is [B]), and ``prefix_allowed_tokens_fn`` is handed the row's index. hf_specdec scores
many prefixes per row (the last token and every guess, rows at different lengths) and calls the processors over
the caller's batch, each prefix at its own row's index. Each test compares a left-padded batch of two (rows with
different padding) with plain ``generate``, greedy fp32, and shows that guesses were drafted and kept.
"""

import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

import hf_specdec
from hf_specdec import SpecConfig
from hf_specdec.processors import process_rows
from tests.conftest import perturbed_copy, tiny_model
from tests.test_batch import left_padded
from tests.test_inputs import modes

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

NEW = 24
PROMPTS = [[5, 17, 42, 8, 23, 5, 17, 42, 8, 23], [3, 4, 5, 6, 3, 4, 5]]  # 0 and 3 columns of padding
FIXED = SpecConfig(policy="fixed", num_draft_tokens=4)  # drafts every round, whatever this machine's timings


def _by_parity(batch_id, sentence):
    """Row 0 may emit even tokens only, row 1 odd ones: a prefix scored at another row's index gets the other
    row's tokens."""
    return list(range(batch_id, 64, 2))


PROCESSED = {
    "repetition_penalty_and_no_repeat_ngram": dict(repetition_penalty=1.3, no_repeat_ngram_size=3),
    "prefix_allowed_tokens_fn_by_row": dict(prefix_allowed_tokens_fn=_by_parity),
}


@pytest.fixture(scope="module")
def model():
    return hf_specdec.enable(tiny_model("llama", seed=0))


@pytest.mark.parametrize("processed", sorted(PROCESSED))
@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_batch_processors_equal_plain_generate(model, mode, processed):
    ids, mask = left_padded(PROMPTS)
    flags = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **PROCESSED[processed])
    expected = type(model).generate(model, ids, **flags)
    unprocessed = type(model).generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                       pad_token_id=0)
    assert not torch.equal(expected, unprocessed)  # the processors change the tokens
    routed = dict(assistant_model=perturbed_copy(model, 0.02), spec_config=FIXED) if mode == "speculative" else \
        modes(model)[mode]
    out = model.generate(ids, **flags, **routed)
    assert torch.equal(out, expected)
    stats = model.last_spec_stats
    assert stats.accepted > 0 and (mode == "lookahead" or stats.drafted - stats.lookup_drafted > 0), stats


def test_each_prefix_is_scored_at_its_own_rows_index(model):
    """A prefix gets its own row's value of a per-row processor: the same prefix at index 1 (3 columns of
    padding, left out of the penalty) and at index 0 (none)."""
    penalty = RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=torch.tensor([0, 3]))
    ids, scores = torch.tensor([3, 4, 5, 6]), torch.ones(8)
    at_1, at_0 = process_rows(LogitsProcessorList([penalty]), 2, [(1, ids, scores), (0, ids, scores)])
    assert at_0[3].item() < 1 and at_1[3].item() == 1  # token 3 sits in row 1's padding columns: not penalized
