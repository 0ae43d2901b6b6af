"""The lookahead layout: exact mask / position tensors, trie building, tree verification, window moves."""

import torch

from hf_specdec.layout import (
    Trie, accepted_input_index, advance_window, build_layout, build_trie, harvest_ngrams, to_model_mask, verify_tree,
)


def test_trie_merges_shared_prefixes_and_respects_the_node_budget():
    trie = build_trie([[5, 6], [5, 7], [8], [9, 9, 9]], max_nodes=5)
    assert trie == Trie(tokens=(5, 6, 7, 8, 9), parents=(-1, 0, 0, -1, -1), depths=(1, 2, 2, 1, 1))
    assert trie.path(2) == [0, 2]
    assert build_trie([[1, 2, 3], [1, 2, 3]], max_nodes=10).tokens == (1, 2, 3)  # duplicates cost nothing
    assert len(build_trie([[1, 2, 3]], max_nodes=0)) == 0


def test_exact_mask_and_positions_for_w2_n3_and_a_small_trie():
    # a) window W=2, N=3: rows[0] = [last=42, 10], rows[1] = [11, 12]
    rows = torch.tensor([[42, 10], [11, 12]])
    # b) trie: 5 -> {6, 7}, and 8 (G=3 candidates, 4 nodes)
    trie = build_trie([[5, 6], [5, 7], [8]], max_nodes=8)
    layout = build_layout(rows, trie, past_length=3)

    assert layout.input_ids.tolist() == [[42, 10, 11, 12, 5, 6, 7, 8]]
    assert layout.position_ids.tolist() == [[3, 4, 4, 5, 4, 5, 5, 4]]
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
    assert layout.attention_mask.shape == (1, 1, 8, 3 + 8)
    assert layout.attention_mask[0, 0, :, :3].all()  # everybody sees the cache
    assert torch.equal(layout.attention_mask[0, 0, :, 3:], expected_inner)
    assert layout.window_out_index.tolist() == [2, 3]
    assert layout.trie_index.tolist() == [0, 4, 5, 6, 7]
    assert accepted_input_index(trie, [0, 2], num_window_tokens=4) == [0, 4, 6]


def test_every_input_sees_a_path_of_consecutive_positions():
    rows = torch.arange(12).reshape(3, 4)  # W=4, N=4
    trie = build_trie([[1, 2, 3], [1, 4], [5, 6]], max_nodes=8)
    layout = build_layout(rows, trie, past_length=0)
    inner = layout.attention_mask[0, 0]
    for i in range(layout.num_tokens):
        seen = inner[i].nonzero().flatten()
        assert layout.position_ids[0, seen].tolist() == list(range(len(seen))), i


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


def test_verify_tree_follows_the_target_through_the_trie():
    trie = build_trie([[7, 8, 9], [7, 8, 5], [3, 4]], max_nodes=10)  # nodes: 7, 8, 9, 5, 3, 4
    #                   root 7  8  9  5  3  4
    assert verify_tree(trie, [7, 8, 9, 0, 0, 0, 0]) == ([0, 1, 2], 0)  # whole first candidate + bonus 0
    assert verify_tree(trie, [7, 8, 5, 0, 2, 0, 0]) == ([0, 1, 3], 2)  # the sibling branch
    assert verify_tree(trie, [3, 0, 0, 0, 0, 4, 6]) == ([4, 5], 6)  # second root child, to its leaf
    assert verify_tree(trie, [7, 1, 0, 0, 0, 0, 0]) == ([0], 1)  # recovered token after one accepted
    assert verify_tree(trie, [2, 0, 0, 0, 0, 0, 0]) == ([], 2)
    assert verify_tree(Trie(), [11]) == ([], 11)


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
