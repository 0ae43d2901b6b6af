"""The slot-addressed KV store (``cache.KVStore``): whatever was written and kept, the next forward gives the
logits a cache holding only the kept tokens gives (fp32, a store built densely from the same tokens).

Each test feeds a written-then-kept store and a dense store the same next token and compares their logits; a
wrong slot, position or mask changes them far beyond the tolerance.
"""

import pytest
import torch

from hf_specdec import cache as kv
from hf_specdec.layout import BatchInputs
from tests.conftest import tiny_model

PROMPT = torch.tensor([[5, 17, 42, 8, 23, 61, 2, 9, 30, 31]])
ATOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0)


def chain(tokens, rows=1) -> BatchInputs:
    """Tokens fed as one plain chain per row ([n] or [B, n])."""
    ids = torch.tensor(tokens, dtype=torch.long).reshape(rows, -1)
    return BatchInputs(ids, torch.arange(ids.shape[1]).repeat(rows, 1), None, None)


def dense_logits(model, tokens, next_token):
    """Logits [V] after ``next_token`` in a store that read ``tokens`` (a list) densely."""
    store = kv.KVStore(model)
    store.prefill(torch.tensor([tokens]), None)
    return store.forward(chain([next_token]), logits_at=1).logits[0, -1]


def masks_seen(model):
    """Records the attention mask of every forward of ``model`` (None: the model's own causal mask)."""
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("attention_mask")),
                                    with_kwargs=True)
    return seen


def test_keep_after_several_writes_takes_a_branch_that_spans_them(model):
    """Write [t, a] and then two siblings b and c after a, one forward each (as a draft model drafting a tree
    depth by depth would); keeping t -> a -> c leaves b as a masked hole (in a batch: one row gathers its path at
    the keep, tests/test_compaction.py). Two rows, the same tokens in each."""
    store = kv.KVStore(model)
    store.prefill(PROMPT.expand(2, -1), None)
    first = store.forward(chain([70, 71] * 2, rows=2))  # t, a
    a = first.slots[:, 1]
    b = store.forward(chain([72, 72], rows=2), after=a)
    c = store.forward(chain([73, 73], rows=2), after=a)
    assert b.slots.tolist() == [[12]] * 2 and c.slots.tolist() == [[13]] * 2 and store.num_written == 4
    torch.testing.assert_close(b.logits[0, -1], dense_logits(model, PROMPT[0].tolist() + [70, 71], 72), atol=ATOL,
                               rtol=0)
    torch.testing.assert_close(c.logits[0, -1], dense_logits(model, PROMPT[0].tolist() + [70, 71], 73), atol=ATOL,
                               rtol=0)
    store.keep([first.slots[r].tolist() + c.slots[r].tolist() for r in range(2)])
    assert store.lengths.tolist() == [13] * 2 and store.valid[0, -2:].tolist() == [False, True] and store.gathers == 0
    logits = store.forward(chain([74, 74], rows=2), logits_at=1).logits[0, -1]
    torch.testing.assert_close(logits, dense_logits(model, PROMPT[0].tolist() + [70, 71, 73], 74), atol=ATOL, rtol=0)


def test_holes_masked_then_compacted_give_the_dense_logits(model):
    store = kv.KVStore(model)
    store.prefill(PROMPT.expand(2, -1), None)  # a batch: holes stay masked until compacted
    tree = BatchInputs(torch.tensor([[70, 71, 72, 73]]).expand(2, -1), torch.tensor([[0, 1, 2, 2]]).expand(2, -1),
                       None, torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]],
                                          dtype=torch.bool).expand(2, -1, -1))
    written = store.forward(tree)
    store.keep([written.slots[r, [0, 1, 3]].tolist() for r in range(2)])  # 70 -> 71 -> 73, a hole where 72 was
    assert not store.dense and store.gathers == 0 and store.width == PROMPT.shape[1] + 4
    expected = dense_logits(model, PROMPT[0].tolist() + [70, 71, 73], 9)
    masked = store.forward(chain([9, 9], rows=2), logits_at=1)
    torch.testing.assert_close(masked.logits[0, -1], expected, atol=ATOL, rtol=0)
    store.discard()
    store.compact()
    assert store.dense and store.gathers == 1 and store.width == PROMPT.shape[1] + 3
    torch.testing.assert_close(store.forward(chain([9, 9], rows=2), logits_at=1).logits[0, -1], expected, atol=ATOL,
                               rtol=0)


def test_a_forward_without_keep_is_forgotten_by_discard(model):
    store = kv.KVStore(model)
    store.prefill(PROMPT, None)
    store.forward(chain([70, 71, 72]))
    store.forward(chain([73]), after=torch.tensor([PROMPT.shape[1] + 2]))
    store.discard()
    assert store.dense and store.num_written == 0 and store.cache.get_seq_length() == PROMPT.shape[1]
    assert all(layer.keys.shape[2] == PROMPT.shape[1] for layer in store.cache.layers)
    logits = store.forward(chain([74]), logits_at=1).logits[0, -1]
    torch.testing.assert_close(logits, dense_logits(model, PROMPT[0].tolist(), 74), atol=ATOL, rtol=0)


def test_keeping_a_prefix_in_one_dense_row_is_a_crop_and_needs_no_mask():
    model = tiny_model("llama", seed=0)  # its own: the hook stays on it
    seen = masks_seen(model)
    store = kv.KVStore(model)
    store.prefill(PROMPT, None)
    written = store.forward(chain([70, 71, 72, 73]))
    store.keep([written.slots[0, :2].tolist()])  # 70, 71: a prefix
    assert store.dense and store.gathers == 0 and store.cache.get_seq_length() == PROMPT.shape[1] + 2
    logits = store.forward(chain([74]), logits_at=1).logits[0, -1]
    assert seen == [None, None, None]  # prefill, the round, the next step: the model's own causal mask
    torch.testing.assert_close(logits, dense_logits(model, PROMPT[0].tolist() + [70, 71], 74), atol=ATOL, rtol=0)


def test_a_draft_chain_kept_over_several_forwards_stays_dense(model):
    """A draft model writes one token per forward; keeping the accepted ones is a crop of what it wrote."""
    store = kv.KVStore(model)
    store.prefill(PROMPT, None)
    slots = store.forward(chain([70])).slots[0].tolist()
    for token in (71, 72, 73):
        slots += store.forward(chain([token]), after=torch.tensor(slots[-1:])).slots[0].tolist()
    store.keep([slots[:3]])
    assert store.dense and store.gathers == 0 and store.lengths.tolist() == [PROMPT.shape[1] + 3]
    logits = store.forward(chain([74]), logits_at=1).logits[0, -1]
    torch.testing.assert_close(logits, dense_logits(model, PROMPT[0].tolist() + [70, 71, 72], 74), atol=ATOL, rtol=0)


def test_two_ragged_rows_each_see_only_their_own_tokens(model):
    """Left-padded prompts of 10 and 4 tokens; the rows write 3 and 1 inputs (padding after the short one) and
    keep 2 and 1: each row's next logits are those of its own tokens alone."""
    short = [40, 41, 42, 43]
    ids = torch.zeros(2, PROMPT.shape[1], dtype=torch.long)
    ids[0], ids[1, -4:] = PROMPT[0], torch.tensor(short)
    mask = torch.ones_like(ids)
    mask[1, :-4] = 0
    store = kv.KVStore(model)
    store.prefill(ids, mask)
    batch = BatchInputs(torch.tensor([[70, 71, 72], [50, 0, 0]]), torch.arange(3).repeat(2, 1),
                        torch.tensor([[True, True, True], [True, False, False]]), None)
    written = store.forward(batch)
    store.keep([written.slots[0, :2].tolist(), written.slots[1, :1].tolist()])
    assert store.lengths.tolist() == [12, 5]
    logits = store.forward(chain([74, 75], rows=2), logits_at=1).logits[:, -1]
    torch.testing.assert_close(logits[0], dense_logits(model, PROMPT[0].tolist() + [70, 71], 74), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], dense_logits(model, short + [50], 75), atol=ATOL, rtol=0)


def test_a_sliding_window_model_gathers_its_path_at_once():
    """Sliding-window layers count columns: a path with a hole is gathered together in the keep itself."""
    model = tiny_model("qwen2", seed=0, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    store = kv.KVStore(model)
    assert not store.holes_maskable()
    store.prefill(PROMPT, None)
    tree = BatchInputs(torch.tensor([[70, 71, 72, 73]]), torch.tensor([[0, 1, 2, 2]]), None,
                       torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool))
    written = store.forward(tree)
    store.keep([written.slots[0, [0, 1, 3]].tolist()])
    assert store.dense and store.gathers == 1 and store.cache.get_seq_length() == PROMPT.shape[1] + 3
    logits = store.forward(chain([74]), logits_at=1).logits[0, -1]
    torch.testing.assert_close(logits, dense_logits(model, PROMPT[0].tolist() + [70, 71, 73], 74), atol=ATOL, rtol=0)


def test_keep_refuses_a_slot_that_is_not_the_rows_next_position(model):
    store = kv.KVStore(model)
    store.prefill(PROMPT, None)
    written = store.forward(chain([70, 71]))
    with pytest.raises(AssertionError, match="next positions"):
        store.keep([written.slots[0, 1:].tolist()])  # 71 without 70


def test_call_model_returns_logits_where_asked_and_hidden_states_on_request(model):
    cache = kv.new_cache(model)
    result = kv.call_model(model, PROMPT, cache, logits_at=torch.tensor([0, 4]), hidden=True)
    assert result.logits.shape == (1, 2, model.config.vocab_size) and result.logits.dtype == torch.float32
    assert result.hidden.shape == (1, 2, model.config.hidden_size) and result.slots is None
    head = model.get_output_embeddings()
    torch.testing.assert_close(head(result.hidden), result.logits, atol=ATOL, rtol=0)
    full = kv.call_model(model, PROMPT, kv.new_cache(model), logits_at=None)
    torch.testing.assert_close(full.logits[:, [0, 4]], result.logits, atol=ATOL, rtol=0)
