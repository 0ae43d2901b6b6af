"""Decoder-only multimodal models: images read once at the prefill through the model's own input preparation, every
later forward text only, positions that depend on the images right for every draft and tree position, exactly as
plain ``generate`` decodes (``hf_specdec/inputs.py``).

Tiny random fp32 models with a hand-built vision tower: a Llava (CLIP patches scattered into 4 image tokens of
the prompt, 1-D positions) and a Qwen2-VL (image tokens whose M-RoPE positions fold a grid, so every later token
sits at its text position + ``rope_delta`` on rows 1-3); and a Qwen2-Audio (mel features into 4 audio tokens).
Each test compares hf_specdec's tokens with plain ``generate``'s, one prompt and a left-padded batch of two, and
shows that the draft drafted tokens the target kept. A multimodal draft reads the images too (the caller's, passed
on by ``enable``'s ``generate``); a text-only draft reads their placeholder ids.
"""

import copy
import inspect

import pytest
import torch
from transformers import (CLIPVisionConfig, LlamaConfig, LlamaForCausalLM, LlavaConfig, LlavaForConditionalGeneration,
                          Qwen2Config, Qwen2ForCausalLM, Qwen2VLConfig, Qwen2VLForConditionalGeneration)

import hf_specdec
from hf_specdec import SpecConfig
from tests.conftest import perturbed_copy
from tests.test_inputs import modes
from tests.test_tree import assert_every_drafting_round_was_a_tree, charged, paying

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

NEW = 20
IMAGE, VIDEO, START, END, PAD = 95, 94, 93, 92, 0
FIXED = SpecConfig(policy="fixed", num_draft_tokens=4)  # drafts every round, whatever this machine's timings
TREE = SpecConfig(tree="on", history_lookup=False)  # a trie every drafting round (on test_tree's virtual clock)
STOP = 85  # an end-of-sequence token the Qwen2-VL's row 0 emits second and its row 1 never
SHARP = 8.0  # the Qwen2-VL's query and key weights scaled by this: random init attends almost uniformly
TEXT = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _plain_config(model):
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(model.generation_config, name, None)
    return hf_specdec.enable(model)


def _left_padded(rows):
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


def _text_draft(model, config_class, model_class):
    """A text-only causal LM holding the multimodal model's language weights, perturbed: it reads the image
    tokens as their placeholder ids."""
    text = model_class(config_class(**TEXT)).eval()
    weights = {f"model.{name}": value for name, value in model.model.language_model.state_dict().items()}
    text.load_state_dict({**weights, "lm_head.weight": model.lm_head.weight}, strict=True)
    return perturbed_copy(text, 0.1, relative=True)


def _check(target, ids, kwargs, routed, mode):
    """hf_specdec's tokens are plain generate's, and the call's draft model (or lookahead) kept some guesses."""
    expected = type(target).generate(target, ids, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **kwargs)
    out = target.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **kwargs, **routed)
    assert torch.equal(out, expected)
    stats = target.last_spec_stats
    if mode == "lookahead":
        assert stats.accepted > 0, stats
    else:
        assert stats.drafted - stats.lookup_drafted > 0 and stats.accepted > 0, stats
    return stats


# -- Llava: image tokens in the prompt ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llava():
    """16x16 images in 8x8 patches: 4 image tokens per image."""
    torch.manual_seed(0)
    config = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                        num_attention_heads=2, image_size=16, patch_size=8),
                         text_config=LlamaConfig(**TEXT), image_token_id=IMAGE)
    return _plain_config(LlavaForConditionalGeneration(config).eval())


def llava_inputs(batch):
    rows = [[IMAGE] * 4 + [5, 17, 42, 8, 23, 61], [7, IMAGE, IMAGE, IMAGE, IMAGE, 11, 12]][:batch]
    ids, mask = _left_padded(rows)
    pixels = torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    return ids, dict(pixel_values=pixels, attention_mask=mask)


def test_the_llava_model_reads_the_image(llava):
    ids, kwargs = llava_inputs(1)
    seen = type(llava).generate(llava, ids, max_new_tokens=NEW, do_sample=False, **kwargs)
    blind = type(llava).generate(llava, ids, max_new_tokens=NEW, do_sample=False)
    assert not torch.equal(seen, blind)  # dropping or misplacing the image changes the tokens


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_llava_equals_plain_generate(llava, mode, batch):
    """Speculative with a multimodal draft (a perturbed Llava that reads the images too), and lookahead."""
    ids, kwargs = llava_inputs(batch)
    draft = perturbed_copy(llava, 0.1, relative=True)
    routed = dict(assistant_model=draft, spec_config=FIXED) if mode == "speculative" else modes(llava)[mode]
    _check(llava, ids, kwargs, routed, mode)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", ["llava", "qwen2_vl"])
def test_a_text_only_draft(name, batch, request):
    """A text-only draft of the same family sees the image placeholders as text; the target reads the images."""
    target = request.getfixturevalue(name)
    inputs, config, model_class = ((llava_inputs, LlamaConfig, LlamaForCausalLM) if name == "llava" else
                                   (qwen2_vl_inputs, Qwen2Config, Qwen2ForCausalLM))
    ids, kwargs = inputs(batch)
    draft = _text_draft(target, config, model_class)
    _check(target, ids, kwargs, dict(assistant_model=draft, spec_config=FIXED), "speculative")


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_llava_with_a_mask_over_an_image_token_equals_plain_generate(llava, mode):
    """A mask that hides one of the image tokens (transformers' testers' ``tril`` masks hide all but the first
    column): plain reads every id, the image's placeholders included. The target reads the image where plain does,
    and so does the multimodal draft: it reads the caller's layout, mask included."""
    ids, kwargs = llava_inputs(1)
    kwargs["attention_mask"] = torch.tensor([[1, 0, 1, 1] + [1] * 6])
    routed = (dict(assistant_model=perturbed_copy(llava, 0.1, relative=True), spec_config=FIXED)
              if mode == "speculative" else modes(llava)[mode])
    _check(llava, ids, kwargs, routed, mode)


# -- Qwen2-VL: multimodal RoPE --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen2_vl():
    """Images of 4x4 patches of 2x2 pixels (2 frames), merged 2x2: 4 image tokens at M-RoPE positions of a 2x2
    grid, so the text after an image sits 2 positions before its index (rope_delta = -2)."""
    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config=dict(**TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                  "rope_theta": 10000.0}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=2, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    model = Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # sharp attention, so that a token's position (hence rope_delta) changes what it reads
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(SHARP)
            layer.self_attn.k_proj.weight.mul_(SHARP)
    return _plain_config(model)


def qwen2_vl_inputs(batch):
    """Row 0: a 4x4-patch image (4 tokens on a 2x2 grid, rope_delta -2); row 1: a 4x8-patch one (8 tokens on a 2x4
    grid, rope_delta -4)."""
    rows = [[5, START] + [IMAGE] * 4 + [END, 17, 42, 8, 23], [START] + [IMAGE] * 8 + [END, 11, 12]][:batch]
    ids, mask = _left_padded(rows)
    grids = torch.tensor([[1, 4, 4], [1, 4, 8]])[:batch]
    patches = torch.randn(int(grids.prod(-1).sum()), 24, generator=torch.Generator().manual_seed(0))
    return ids, dict(pixel_values=patches, image_grid_thw=grids, mm_token_type_ids=(ids == IMAGE).int(),
                     attention_mask=mask)


def test_the_qwen2_vl_model_reads_the_image_and_its_positions(qwen2_vl):
    ids, kwargs = qwen2_vl_inputs(1)
    seen = type(qwen2_vl).generate(qwen2_vl, ids, max_new_tokens=NEW, do_sample=False, **kwargs)
    assert int(qwen2_vl.model.rope_deltas[0]) == -2  # later tokens sit 2 positions before their index on rows 1-3
    blind = type(qwen2_vl).generate(qwen2_vl, ids, max_new_tokens=NEW, do_sample=False)
    assert not torch.equal(seen, blind)


def _routed_check(model, ids, kwargs, mode, monkeypatch):
    """``_check`` of ``model`` in ``mode``: chains with a multimodal draft (a perturbed copy, fixed k), lookahead,
    or draft-model trees (every drafting round a tree); returns the stats."""
    draft = perturbed_copy(model, 0.1, relative=True)
    if mode == "speculative":
        routed = dict(assistant_model=draft, spec_config=FIXED)
    elif mode == "tree":
        signature = inspect.signature(model.forward)
        charged(monkeypatch, model, draft)
        model.forward.__signature__ = signature  # generate() checks the image inputs against it
        routed = dict(assistant_model=draft, spec_config=TREE, speculative_memory=paying(draft))
    else:
        routed = modes(model)[mode]
    stats = _check(model, ids, kwargs, routed, "lookahead" if mode == "lookahead" else "speculative")
    if mode == "tree":
        assert_every_drafting_round_was_a_tree(stats)
    return stats


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mode", ["speculative", "lookahead", "tree"])
def test_qwen2_vl_equals_plain_generate(qwen2_vl, mode, batch, monkeypatch):
    """Every draft, window and tree position at text position + rope_delta on rows 1-3: chains with a multimodal
    draft, lookahead's trie and window, and draft-model trees."""
    ids, kwargs = qwen2_vl_inputs(batch)
    _routed_check(qwen2_vl, ids, kwargs, mode, monkeypatch)


def _stopping_check(model, ids, kwargs, mode, stop):
    """``_check`` of ``model`` (a multimodal draft, or lookahead) with ``stop`` as EOS; returns plain's output."""
    draft = perturbed_copy(model, 0.1, relative=True)
    routed = dict(assistant_model=draft, spec_config=FIXED) if mode == "speculative" else modes(model)[mode]
    _check(model, ids, dict(kwargs, eos_token_id=stop), routed, mode)
    return type(model).generate(model, ids, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, eos_token_id=stop,
                                **kwargs)


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_qwen2_vl_rows_that_stop_take_their_positions_along(qwen2_vl, mode):
    """Row 0 stops at its second token (STOP, which row 1 never emits); row 1 goes on alone at its own
    rope_delta (-4, not row 0's -2)."""
    ids, kwargs = qwen2_vl_inputs(2)
    out = _stopping_check(qwen2_vl, ids, kwargs, mode, STOP)
    width = ids.shape[1]
    assert out[0, width + 1] == STOP and bool((out[0, width + 2:] == PAD).all()) and STOP not in out[1, width:]


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("name", ["llava", "qwen2_vl"])
def test_a_multimodal_draft_reads_the_images_at_their_positions(name, holes, request):
    """A draft with the target's own weights reads the images and their positions as the target does: the target
    keeps every token it drafts (reading the placeholder ids instead, it would not). With holes in the mask (in
    the text; Llava's also over an image token and row 1's first column, so that no row is whole: Qwen2-VL's own
    rope index takes neither) the draft reads the prompts in the caller's layout, as the target does."""
    target = request.getfixturevalue(name)
    ids, kwargs = (llava_inputs if name == "llava" else qwen2_vl_inputs)(2)
    if holes:
        mask = kwargs["attention_mask"].clone()
        mask[0, -3], mask[1, -2] = 0, 0
        if name == "llava":
            mask[0, (ids[0] == IMAGE).nonzero()[1]] = 0
            mask[1, (mask[1] == 1).nonzero()[0]] = 0
        kwargs = dict(kwargs, attention_mask=mask)
    stats = _check(target, ids, kwargs, dict(assistant_model=copy.deepcopy(target), spec_config=FIXED),
                   "speculative")
    assert stats.accepted == stats.drafted - stats.lookup_drafted, stats


# -- Qwen2-Audio: audio features in the prompt ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen2_audio():
    """16 mel frames (16 bins) are 4 audio tokens after the encoder's stride and pooling."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2AudioConfig(audio_config=dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2,
                                                encoder_ffn_dim=32, d_model=16, max_source_positions=8),
                              text_config=dict(model_type="qwen2", **TEXT), audio_token_index=IMAGE)
    return _plain_config(Qwen2AudioForConditionalGeneration(config).eval())


def test_qwen2_audio_equals_plain_generate_and_its_draft_hears_the_audio(qwen2_audio):
    """Audio features read at the prefill by the target and by a draft of the same weights (which then has every
    token it drafts kept). The model has no 4-D tree mask, so lookahead is refused for it (support.py)."""
    ids = torch.tensor([[5, 7] + [IMAGE] * 4 + [17, 42, 8, 23]])
    kwargs = dict(input_features=torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(0)),
                  feature_attention_mask=torch.ones(1, 16, dtype=torch.long))
    deaf = type(qwen2_audio).generate(qwen2_audio, ids, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    routed = dict(assistant_model=copy.deepcopy(qwen2_audio), spec_config=FIXED)
    stats = _check(qwen2_audio, ids, kwargs, routed, "speculative")
    assert stats.accepted == stats.drafted - stats.lookup_drafted, stats
    assert not torch.equal(deaf, type(qwen2_audio).generate(qwen2_audio, ids, max_new_tokens=NEW, do_sample=False,
                                                            pad_token_id=PAD, **kwargs))  # the model hears it


# -- PaliGemma 2: one mask for full and sliding-window layers --------------------------------------------------------
@pytest.fixture(scope="module")
def paligemma2():
    """transformers' PaliGemma2 tester's config (a Gemma 2 with full and sliding-window layers, a SigLIP tower of
    20x20 images in 5x5 patches: 16 image tokens): its forward builds both layer kinds' masks from the one mask it
    is given, and hands a 4-D one to every layer as it is."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    torch.manual_seed(0)
    config = PaliGemmaConfig(
        text_config=dict(model_type="gemma2", vocab_size=99, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=8, intermediate_size=37,
                         hidden_activation="gelu_pytorch_tanh", max_position_embeddings=512, pad_token_id=1),
        vision_config=dict(image_size=20, patch_size=5, num_channels=3, hidden_size=32, projection_dim=32,
                           num_hidden_layers=2, num_attention_heads=4, intermediate_size=37),
        image_token_index=0, projection_dim=32)
    return _plain_config(PaliGemmaForConditionalGeneration(config).eval())


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_paligemma2_equals_plain_generate(paligemma2, mode):
    """Lookahead's trie masks reach the model as one 4-D mask (not one per layer type, which its forward does not
    take), exact while the sliding window covers every column."""
    assert paligemma2.config.text_config.layer_types == ["sliding_attention", "full_attention"]
    ids = torch.tensor([[0] * 16 + [2, 5, 7, 9, 5, 7, 9, 5, 7]])
    kwargs = dict(pixel_values=torch.randn(1, 3, 20, 20, generator=torch.Generator().manual_seed(0)),
                  token_type_ids=torch.zeros_like(ids))
    routed = (dict(assistant_model=perturbed_copy(paligemma2, 0.1, relative=True), spec_config=FIXED)
              if mode == "speculative" else modes(paligemma2)[mode])
    _check(paligemma2, ids, kwargs, routed, mode)


# -- IDEFICS: images read by cross-attention, each token's images in image_attention_mask ----------------------------
@pytest.fixture(scope="module")
def idefics():
    """transformers' IDEFICS tester's config: 30x30 images in 2x2 patches, read by gated cross-attention layers;
    ``image_attention_mask`` [B, P, images] says which images each token attends to (none: its gate is 0)."""
    from transformers import IdeficsConfig, IdeficsForVisionText2Text

    torch.manual_seed(0)
    config = IdeficsConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        hidden_act="gelu", max_position_embeddings=512, alpha_initializer="ones",
        vision_config=dict(embed_dim=32, patch_size=2, image_size=30, num_attention_heads=4, num_hidden_layers=2,
                           intermediate_size=37),
        perceiver_config=dict(resampler_depth=2, resampler_head_dim=8, resampler_n_heads=2, resampler_n_latents=16))
    return _plain_config(IdeficsForVisionText2Text(config).eval())


IDEFICS_STOP = 65  # row 0 of idefics_inputs emits it second, row 1 never


def idefics_inputs(batch, mask=None):
    """Two images per row; row 0 (whole) attends to image 0 from its second token and to image 1 from its sixth,
    row 1 (2 columns of padding) to its image 1 from its fourth column. Plain gives every new token its row's last
    ``image_attention_mask`` row."""
    ids = torch.tensor([[7, 11, 12, 13, 14, 15, 16, 9], [PAD, PAD, 5, 17, 42, 8, 23, 61]])[:batch]
    images = torch.zeros(2, 8, 2, dtype=torch.long)
    images[0, 1:, 0], images[0, 5:, 1], images[1, 3:, 1] = 1, 1, 1
    mask = torch.tensor([[1] * 8, [0, 0] + [1] * 6]) if mask is None else mask
    return ids, dict(pixel_values=torch.randn(2, 2, 3, 30, 30, generator=torch.Generator().manual_seed(0))[:batch],
                     image_attention_mask=images[:batch], attention_mask=mask[:batch])


def test_the_idefics_model_reads_each_tokens_images(idefics):
    ids, kwargs = idefics_inputs(2)
    seen = type(idefics).generate(idefics, ids, max_new_tokens=NEW, do_sample=False, **kwargs)
    for row in (0, 1):  # a new token's images are its row's last: without them, the row's tokens change
        blind = kwargs["image_attention_mask"].clone()
        blind[row, -1] = 0
        other = type(idefics).generate(idefics, ids, max_new_tokens=NEW, do_sample=False,
                                       **dict(kwargs, image_attention_mask=blind))
        assert not torch.equal(seen[row], other[row]) and torch.equal(seen[1 - row], other[1 - row])


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mode", ["speculative", "lookahead", "tree"])
def test_idefics_equals_plain_generate(idefics, mode, batch, monkeypatch):
    """Every drafted token, window input and tree node attends to its row's last images, read from the images the
    prompt's forward encoded (``image_encoder_embeddings``, as plain's steps): chains with an IDEFICS draft (which
    encodes its own), lookahead's trie and window, and draft-model trees."""
    ids, kwargs = idefics_inputs(batch)
    stats = _routed_check(idefics, ids, kwargs, mode, monkeypatch)
    if mode == "lookahead":
        assert stats.tree_rounds > 0, stats  # IDEFICS reads a trie


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_idefics_rows_that_stop_leave_their_images(idefics, mode):
    """Row 0 stops at its second token; row 1 goes on alone with its own two encoded images (the batch's encoded
    images are two per row: the rows that stop take theirs along)."""
    ids, kwargs = idefics_inputs(2)
    out = _stopping_check(idefics, ids, kwargs, mode, IDEFICS_STOP)
    assert out[0, ids.shape[1] + 1] == IDEFICS_STOP and IDEFICS_STOP not in out[1, ids.shape[1]:]


# masks with holes and padding, as transformers' IDEFICS testers pass them (their ``tril`` masks hide all but a
# row's first columns): row 0 with a hole, row 1 padded with a hole; every row padded; only each row's first tokens
IDEFICS_MASKS = {
    "a_hole": torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 1, 1, 1]]),
    "every_row_padded": torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]]),
    "first_tokens_only": torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0]]),
}


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mask", sorted(IDEFICS_MASKS))
def test_an_idefics_draft_reads_the_callers_layout(idefics, mask, batch):
    """An IDEFICS draft reads its images by cross-attention, each token's through its ``image_attention_mask`` row:
    it reads the prompts as the target does, every column, padding and holes masked, so its tokens' image rows are
    the caller's. A draft with the target's weights then has every drafted token kept; plain's tokens either way."""
    ids, kwargs = idefics_inputs(batch, mask=IDEFICS_MASKS[mask])
    stats = _check(idefics, ids, kwargs, dict(assistant_model=copy.deepcopy(idefics), spec_config=FIXED),
                   "speculative")
    assert stats.accepted == stats.drafted - stats.lookup_drafted, stats
    _check(idefics, ids, kwargs, dict(assistant_model=perturbed_copy(idefics, 0.1, relative=True),
                                      spec_config=FIXED), "speculative")


def test_an_idefics_draft_whose_row_stops_at_its_first_token_reads_the_others(idefics):
    """Row 0 emits its end token first (a row the loop drops before the draft reads anything): the draft reads
    both prompts in the caller's layout, then keeps row 1's images only."""
    ids, kwargs = idefics_inputs(2, mask=IDEFICS_MASKS["a_hole"])
    first = type(idefics).generate(idefics, ids, max_new_tokens=1, do_sample=False, pad_token_id=PAD, **kwargs)
    stop = int(first[0, -1])
    assert stop not in first[1, ids.shape[1]:]
    stats = _check(idefics, ids, dict(kwargs, eos_token_id=stop),
                   dict(assistant_model=copy.deepcopy(idefics), spec_config=FIXED), "speculative")
    assert stats.accepted == stats.drafted - stats.lookup_drafted, stats


def test_an_idefics_draft_after_a_cache_passed_in_is_refused_before_any_forward(idefics):
    """With a cache passed in and ``input_ids`` the tokens after it, the draft has not read the prompt's first
    tokens and could read the rest only as text, which an IDEFICS draft cannot do without its images: refused
    before any forward, naming the input and the ways out."""
    from transformers import DynamicCache

    from tests.test_inputs import CountAllForwards

    ids, kwargs = idefics_inputs(1, mask=IDEFICS_MASKS["a_hole"])
    cache = DynamicCache(config=idefics.config)
    with torch.no_grad():
        idefics(input_ids=ids[:, :4], attention_mask=kwargs["attention_mask"][:, :4], cache=cache,
                pixel_values=kwargs["pixel_values"], image_attention_mask=kwargs["image_attention_mask"][:, :4])
    kwargs = dict(kwargs, image_attention_mask=kwargs["image_attention_mask"][:, 4:])
    with CountAllForwards() as forwards, pytest.raises(
            hf_specdec.inputs.UnsupportedInput,
            match=r"cannot run the draft model \(IdeficsForVisionText2Text\) on this prompt: it reads images through "
                  r"image_attention_mask.*a cache passed in.*text-only draft model, or decoding='lookahead'"):
        idefics.generate(ids[:, 4:], max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, cache=cache,
                         assistant_model=copy.deepcopy(idefics), spec_config=FIXED, **kwargs)
    assert forwards.count == 0


def test_an_idefics_draft_grows_trees_over_a_mask_with_holes(idefics, monkeypatch):
    """Draft-model trees: the draft reads the caller's layout, then every node attends to its row's last images."""
    ids, kwargs = idefics_inputs(2, mask=IDEFICS_MASKS["a_hole"])
    draft = copy.deepcopy(idefics)
    signature = inspect.signature(idefics.forward)
    charged(monkeypatch, idefics, draft)
    idefics.forward.__signature__ = signature  # generate() checks the image inputs against it
    stats = _check(idefics, ids, kwargs, dict(assistant_model=draft, spec_config=TREE,
                                              speculative_memory=paying(draft)), "speculative")
    assert_every_drafting_round_was_a_tree(stats)


# -- Mllama: images in the text cache's cross-attention layers, each token's through cross_attention_mask -----------
@pytest.fixture(scope="module")
def mllama():
    """transformers' Mllama tester's config: one image of 4 tiles (904 vision tokens), cross-attention at layer 1."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    torch.manual_seed(0)
    text = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=37, hidden_act="gelu", max_position_embeddings=512,
                rope_parameters={"rope_type": "default"}, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                cross_attention_layers=[1])
    vision = dict(image_size=30, patch_size=2, num_channels=3, hidden_size=16, intermediate_layers_indices=[0],
                  vision_output_dim=32, projection_dim=32, num_hidden_layers=2, num_global_layers=2,
                  num_attention_heads=4, intermediate_size=37,
                  supported_aspect_ratios=[[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]])
    config = MllamaConfig(text_config=text, vision_config=vision, image_token_index=4)
    return _plain_config(MllamaForConditionalGeneration(config).eval())


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_mllama_with_images_in_its_text_cache_is_plain_generate(mllama, mode):
    """Mllama keeps the images' keys in its text cache's cross-attention layers, written by the prompt's forward
    (``backends.Fixed``: a round's keep leaves them as they are, rows that stop leave them) and each token's
    ``cross_attention_mask`` row grows as Mllama's own update grows it (a per-token input). Gates at 1, so the
    images reach the text (the tester's random gates are 0); B = 2, one row padded and seeing half the tiles."""
    with torch.no_grad():
        for name, parameter in mllama.named_parameters():
            if "cross_attn_attn_gate" in name or "cross_attn_mlp_gate" in name:
                parameter.fill_(1.0)
    ids = torch.tensor([[7, 4, 11, 12, 13, 14, 15, 16], [PAD, PAD, 5, 4, 42, 8, 23, 61]])
    crossed = torch.zeros(2, 8, 1, 4)
    crossed[0, 1:, 0], crossed[1, 3:, 0, :2] = 1, 1
    kwargs = dict(pixel_values=torch.randn(2, 1, 4, 3, 30, 30, generator=torch.Generator().manual_seed(0)),
                  aspect_ratio_ids=torch.tensor([[6], [5]]),
                  aspect_ratio_mask=torch.tensor([[[1] * 4], [[1, 1, 0, 0]]]),
                  cross_attention_mask=crossed, attention_mask=torch.tensor([[1] * 8, [0, 0] + [1] * 6]))
    steps = hf_specdec.inputs.ModelInputs.from_generate(mllama, ids, dict(kwargs, use_cache=True))
    assert torch.equal(steps.step(3)["cross_attention_mask"], crossed[:, -1:].expand(-1, 3, -1, -1))
    plain = mllama.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **kwargs)
    without_images = mllama.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                                     attention_mask=kwargs["attention_mask"])
    assert not torch.equal(plain, without_images)  # the images decide tokens
    model = hf_specdec.enable(mllama)
    extra = dict(assistant_model=mllama, spec_config={"policy": "fixed", "num_draft_tokens": 3}) \
        if mode == "speculative" else dict(decoding="lookahead")
    if mode == "lookahead":  # a memory that knows the answer: its guesses are verified over the images
        memory = hf_specdec.LookaheadMemory()
        model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, lookahead_memory=memory,
                       **extra, **kwargs)
        extra["lookahead_memory"] = memory
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **extra, **kwargs)
    stats = model.last_spec_stats.get()
    hf_specdec.disable(mllama)
    assert torch.equal(out, plain)
    assert stats.accepted > 0 and (mode == "lookahead" or stats.drafted - stats.lookup_drafted > 0), stats
