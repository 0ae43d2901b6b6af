"""The round layout: exact mask / position tensors, trie merging, window moves (geometry only)."""

import torch

from hf_specdec.layout import (advance_window, harvest_ngrams, is_plain_chain, merge_candidates, round_layout,
                               stack_layouts, to_model_mask, window_inputs)
from hf_specdec.round import Candidate, Proposal, Source, SourceKind

POOL = (SourceKind.POOL, 0)


def trie_of(*candidates, max_nodes=64, **fields):
    return merge_candidates([Candidate(tuple(c), POOL) for c in candidates], max_nodes, **fields)


def test_trie_merges_shared_prefixes_and_respects_the_node_budget():
    trie = trie_of([5, 6], [5, 7], [8], [9, 9, 9], max_nodes=5)
    assert (trie.tokens, trie.parents, trie.depths) == ((5, 6, 7, 8, 9), (-1, 0, 0, -1, -1), (1, 2, 2, 1, 1))
    assert trie.path(2) == [0, 2]
    assert trie.sources[0] == (Source(SourceKind.POOL, 0, 1),) * 2  # two candidates of one source: each is judged
    assert trie_of([1, 2, 3], [1, 2, 3]).tokens == (1, 2, 3)  # duplicates cost nothing
    assert trie_of([1, 2, 3], max_nodes=0).num_tokens == 0


def test_exact_mask_and_positions_for_w2_n3_and_a_small_trie():
    # a) window W=2, N=3: rows[0] = [last=42, 10], rows[1] = [11, 12]
    extra = window_inputs(torch.tensor([[42, 10], [11, 12]]))
    # b) trie: 5 -> {6, 7}, and 8 (G=3 candidates, 4 nodes)
    trie = trie_of([5, 6], [5, 7], [8], extra=extra)
    step = round_layout(trie, last_token=42)

    assert step.input_ids.tolist() == [42, 10, 11, 12, 5, 6, 7, 8]
    assert step.offsets.tolist() == [0, 1, 1, 2, 1, 2, 2, 1]
    expected_inner = torch.tensor([
        # L  a  b  c  5  6  7  8
        [1, 0, 0, 0, 0, 0, 0, 0],  # last token
        [1, 1, 0, 0, 0, 0, 0, 0],  # rows[0, 1]: causal along row 0
        [1, 0, 1, 0, 0, 0, 0, 0],  # rows[1, 0]: rows[0, 0] + its column
        [1, 1, 0, 1, 0, 0, 0, 0],  # rows[1, 1]: rows[0, 0..1] + its column
        [1, 0, 0, 0, 1, 0, 0, 0],  # node 5
        [1, 0, 0, 0, 1, 1, 0, 0],  # node 6 (child of 5)
        [1, 0, 0, 0, 1, 0, 1, 0],  # node 7 (child of 5, sibling of 6)
        [1, 0, 0, 0, 0, 0, 0, 1],  # node 8
    ], dtype=torch.bool)
    assert torch.equal(step.inner, expected_inner)
    # logits: the last token, the nodes, then the window's bottom row
    assert step.logits_index.tolist() == [0, 4, 5, 6, 7, 2, 3]
    assert step.read_rows.tolist() == [5, 6]
    assert step.kept_inputs([0, 2]) == [0, 4, 6]


def test_a_plain_chain_needs_no_mask_and_no_positions():
    chain = Proposal.chain([5, 6, 7], [Source(SourceKind.DRAFT, 0, i) for i in (1, 2, 3)])
    assert is_plain_chain(chain) and is_plain_chain(chain.__class__())
    step = round_layout(chain, last_token=4)
    assert step.input_ids.tolist() == [4, 5, 6, 7] and step.offsets.tolist() == [0, 1, 2, 3]
    assert step.inner is None
    assert step.kept_inputs([0, 1]) == [0, 1, 2]
    # the empty window reads the last token's own row, and is still a plain chain
    empty = window_inputs(torch.tensor([[4]]))
    with_window = Proposal.chain([5], [Source(SourceKind.POOL, 0, 1)], extra=empty)
    assert is_plain_chain(with_window) and round_layout(with_window, 4).read_rows.tolist() == [0]
    assert not is_plain_chain(trie_of([5, 6], [5, 7]))


def test_every_input_sees_a_path_of_consecutive_positions():
    extra = window_inputs(torch.arange(12).reshape(3, 4))  # W=4, N=4
    trie = trie_of([1, 2, 3], [1, 4], [5, 6], extra=extra)
    step = round_layout(trie, last_token=0)
    for i in range(step.num_tokens):
        seen = step.inner[i].nonzero().flatten()
        assert step.offsets[seen].tolist() == list(range(len(seen))), i


def test_stacked_rows_pad_with_inputs_that_see_only_themselves():
    chain = round_layout(Proposal.chain([5, 6], [Source(SourceKind.DRAFT, 0, 1), Source(SourceKind.DRAFT, 0, 2)]), 4)
    tree = round_layout(trie_of([7, 8], [7, 9]), 3)
    batch = stack_layouts([chain, tree], pad_token=0)
    assert batch.input_ids.tolist() == [[4, 5, 6, 0], [3, 7, 8, 9]]
    assert batch.valid.tolist() == [[True, True, True, False], [True] * 4]
    assert batch.inner[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]
    assert torch.equal(batch.inner[1], tree.inner)
    assert stack_layouts([chain, chain]).inner is None and stack_layouts([chain, chain]).valid is None


def test_model_masks_for_sdpa_and_eager():
    mask = torch.tensor([[[[True, False]]]])
    assert to_model_mask(mask, "sdpa", torch.float32) is mask
    eager = to_model_mask(mask, "eager", torch.bfloat16)
    assert eager.dtype == torch.bfloat16 and eager[0, 0, 0, 0] == 0 and eager[0, 0, 0, 1] == torch.finfo(torch.bfloat16).min
    try:
        to_model_mask(mask, "flash_attention_2", torch.float16)
    except ValueError as error:
        assert "sdpa" in str(error)
    else:
        raise AssertionError("flash attention must be refused")


def test_harvest_takes_ready_columns_only():
    rows = torch.tensor([[1, 2, 3], [4, 5, 6]])  # N=3, W=3
    out = torch.tensor([7, 8, 9])
    age = torch.tensor([5, 1, 0])  # column 2 still holds placeholders below its key
    assert harvest_ngrams(rows, out, age) == [(1, 4, 7), (2, 5, 8)]


def test_advance_window_moves_up_a_level_and_realigns_to_what_was_committed():
    rows = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])  # N=3, W=4; rows[l, j] at p + l + j
    out = torch.tensor([9, 10, 11, 12])  # guesses at p + 2 + j
    age = torch.tensor([3, 3, 3, 3])
    fill = torch.full((2, 4), 0)
    # one token committed (LADE's only case): level up, no shift
    new_rows, new_age = advance_window(rows, out, age, num_emitted=1, next_last=50, fill=fill)
    assert new_rows.tolist() == [[50, 6, 7, 8], [9, 10, 11, 12]]
    assert new_age.tolist() == [4, 4, 4, 4]
    # three tokens committed: columns shift left by 2, two fresh columns enter with age 0
    new_rows, new_age = advance_window(rows, out, age, num_emitted=3, next_last=50, fill=fill)
    assert new_rows.tolist() == [[50, 8, 0, 0], [11, 12, 0, 0]]
    assert new_age.tolist() == [4, 4, 0, 0]
    # position check: new rows[l, j] sits at p + 3 + l + j; old rows[l+1, j+2] sat at p + (l+1) + (j+2)
