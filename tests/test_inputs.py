"""Every input and flag generate() takes is carried as plain generate() carries it, or refused before any forward
with an error that names it and says what to do: nothing is dropped silently."""

import copy
from collections import Counter

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hf_specdec
from tests.conftest import perturbed_copy, tiny_model
from tests.test_sampling import (DRAWS, NEW as SAMPLED_NEW, PROMPT as SAMPLED_PROMPT, SAMPLING, V, assert_fits,
                                 exact_distribution, processors)

NEW = 24
FIXED = hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=4)  # drafts every round, whatever the timings


@pytest.fixture(scope="module")
def llama():
    return hf_specdec.enable(tiny_model("llama", seed=0))


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, bos_token_id=None,
                                       eos_token_id=None)).eval()
    return hf_specdec.enable(model)


def modes(model):
    """The two ways into hf_specdec, each with injected costs that make guessing pay from the first round."""
    flat = {n: 1.0 for n in range(1, 17)}
    memory = hf_specdec.SpeculativeMemory()
    memory.seed(model, forward_seconds=flat, draft_step_seconds=0.01)
    pool = hf_specdec.LookaheadMemory()
    pool.seed(flat)
    return {"speculative": dict(assistant_model=model, speculative_memory=memory),
            "lookahead": dict(decoding="lookahead", lookahead_memory=pool)}


TYPES = torch.tensor([[0, 0, 0, 1, 1, 1, 11, 11]])  # the prompt's token types: every new token is of type 11


def typed_batch(prompt, batch):
    """One prompt with its types, or two left-padded rows (the second 3 tokens shorter, its last type 5)."""
    if batch == 1:
        return prompt, TYPES, None
    ids = torch.cat([prompt, torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt[:, 3:]], dim=1)])
    types = torch.cat([TYPES, torch.tensor([[0, 0, 0, 2, 2, 4, 4, 5]])])
    return ids, types, torch.tensor([[1] * 8, [0] * 3 + [1] * 5])


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_token_type_ids_equal_plain_generate(gpt2, prompt, mode, batch):
    """The prompt's types at the prefill, the last one repeated for every new token (drafted, tree node, window
    input), as plain generate() extends them."""
    ids, types, mask = typed_batch(prompt, batch)
    flags = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    expected = type(gpt2).generate(gpt2, ids, token_type_ids=types, **flags)
    assert not torch.equal(expected, type(gpt2).generate(gpt2, ids, **flags))  # the model reads them
    routed = dict(assistant_model=perturbed_copy(gpt2, 0.02), spec_config=FIXED) if mode == "speculative" else \
        modes(gpt2)[mode]
    out = gpt2.generate(ids, token_type_ids=types, **flags, **routed)
    assert torch.equal(out, expected)
    stats = gpt2.last_spec_stats
    assert stats.accepted > 0 and (mode == "lookahead" or stats.drafted - stats.lookup_drafted > 0), stats


def test_a_draft_model_reads_the_token_types(gpt2, prompt):
    """A draft with the target's weights gets the same types (the prompt's, then the last one): the target keeps
    every token it drafts."""
    ids, types, mask = typed_batch(prompt, 2)
    gpt2.generate(ids, token_type_ids=types, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                  pad_token_id=0, assistant_model=copy.deepcopy(gpt2), spec_config=FIXED)
    stats = gpt2.last_spec_stats
    assert stats.accepted == stats.drafted - stats.lookup_drafted > 0, stats


@pytest.mark.usefixtures("one_thread")
def test_sampling_with_token_type_ids_follows_the_target():
    """Sampled continuations with token types follow the target's processed distribution given those types (the
    chi-square test of tests/test_sampling.py), with draft tokens accepted."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=V, bos_token_id=None,
                                       eos_token_id=None, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits spread over a few units (random init is almost uniform)
    hf_specdec.enable(model)
    draft = perturbed_copy(model, 0.01)
    types = torch.tensor([[0, 0, 0, 1, 1, 1, 3, 3]])

    def typed(ids):  # the target as plain generate() calls it: the prompt's types, then the last one repeated
        extra = types[:, -1:].expand(1, ids.shape[1] - types.shape[1])
        return model(ids, token_type_ids=torch.cat([types, extra], dim=1))

    exact = exact_distribution(typed, SAMPLED_PROMPT, SAMPLED_NEW, processors(**SAMPLING))
    untyped = exact_distribution(model, SAMPLED_PROMPT, SAMPLED_NEW, processors(**SAMPLING))
    assert max(abs(exact.get(k, 0.0) - untyped.get(k, 0.0)) for k in exact | untyped) > 0.05  # types matter
    torch.manual_seed(1)
    counts, accepted = Counter(), 0
    for _ in range(DRAWS):
        out = model.generate(SAMPLED_PROMPT, token_type_ids=types, do_sample=True, max_new_tokens=SAMPLED_NEW,
                             **SAMPLING, assistant_model=draft, spec_config=FIXED)
        counts[tuple(out[0, SAMPLED_PROMPT.shape[1]:].tolist())] += 1
        accepted += model.last_spec_stats.accepted
    assert accepted > 0
    assert_fits(counts, exact)


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_what_generate_adds_for_a_text_model_is_not_refused(llama, gpt2, prompt, mode):
    for model in (llama, gpt2):
        mask = torch.ones_like(prompt)
        expected = type(model).generate(model, prompt, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **modes(model)[mode])
        assert torch.equal(out, expected)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_inputs_embeds_equal_plain_generate(llama, prompt, mode, batch):
    """A prompt given as embeddings: the prefill reads them, as plain generate() does, and the sequences hold only
    the new tokens, as plain's do (the draft and the n-gram pool see the new tokens only)."""
    ids = prompt if batch == 1 else torch.cat([prompt, torch.cat([torch.zeros(1, 2, dtype=torch.long),
                                                                  prompt[:, 2:]], dim=1)])
    mask = None if batch == 1 else torch.tensor([[1] * 8, [0] * 2 + [1] * 6])
    with torch.no_grad():
        embeds = llama.get_input_embeddings()(ids)
    flags = dict(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    expected = type(llama).generate(llama, **flags)
    assert expected.shape == (batch, NEW)  # plain returns the new tokens only
    draft = perturbed_copy(llama, 0.1, relative=True)  # close enough to agree without having seen the prompt
    routed = dict(assistant_model=draft, spec_config=FIXED) if mode == "speculative" else modes(llama)[mode]
    out = llama.generate(**flags, **routed)
    assert torch.equal(out, expected)
    stats = llama.last_spec_stats
    assert stats.accepted > 0 and (mode == "lookahead" or stats.drafted - stats.lookup_drafted > 0), stats


def test_a_text_call_asks_the_model_nothing_and_passes_nothing_more(llama, prompt, monkeypatch):
    """Without token types, images, embeddings or multimodal positions, the call never runs the model's input
    preparation and its forwards get the loop's own arguments only."""
    def untouchable(*args, **kwargs):
        raise AssertionError("prepare_inputs_for_generation called")

    seen = []
    handle = llama.register_forward_pre_hook(lambda module, args, kwargs: seen.append(sorted(kwargs)),
                                             with_kwargs=True)
    monkeypatch.setattr(llama, "prepare_inputs_for_generation", untouchable)
    try:
        for mode in ("speculative", "lookahead"):
            llama.generate(prompt, max_new_tokens=8, do_sample=False, **modes(llama)[mode])
    finally:
        handle.remove()
    assert seen and all(set(names) <= {"input_ids", "cache", "use_cache", "logits_to_keep", "position_ids",
                                       "attention_mask"} for names in seen), seen


def test_an_input_whose_steps_change_its_shape_is_refused_by_name():
    """An input the model's own preparation cuts to the new tokens, which hf_specdec does not know how to carry
    over several new tokens at once."""
    from transformers import LlamaForCausalLM

    class Growing(LlamaForCausalLM):
        def prepare_inputs_for_generation(self, input_ids, **kwargs):
            inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
            inputs["row_weights"] = inputs["row_weights"][:, -inputs["input_ids"].shape[1]:]  # one per new token
            return inputs

    model = Growing(tiny_model("llama").config).eval()
    prompt = torch.tensor([[5, 17, 42]])
    with pytest.raises(hf_specdec.inputs.UnsupportedInput, match=r"hf_specdec does not know how row_weights grows "
                                                                 r"with new tokens .*; use plain generate\(\) for this "
                                                                 r"input\."):
        hf_specdec.inputs.ModelInputs.from_generate(model, prompt, {"row_weights": torch.ones(1, 3)})


@pytest.mark.parametrize("shape", [(1, 3), (1, 11), (2, 8)])
@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_an_all_ones_mask_of_another_shape_is_refused(llama, prompt, shape, mode):
    mask = torch.ones(shape, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"attention_mask.* has shape \({shape[0]}, {shape[1]}\) but input_ids has "
                                         r"shape \(1, 8\)"):
        llama.generate(prompt, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **modes(llama)[mode])


def test_a_padded_mask_of_another_shape_is_refused(llama, prompt):
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 10\) but input_ids has shape \(1, 8\)"):
        llama.generate(prompt, attention_mask=mask, max_new_tokens=NEW, do_sample=False, decoding="lookahead")


# -- arguments of the other mode ------------------------------------------------------------------------------------
def test_assistant_model_with_lookahead_is_refused(llama, prompt):
    with pytest.raises(ValueError, match=r"decoding='lookahead' .* would ignore assistant_model=; drop"):
        llama.generate(prompt, assistant_model=llama, decoding="lookahead", max_new_tokens=NEW)


def test_spec_config_with_lookahead_is_refused(llama, prompt):
    with pytest.raises(ValueError, match=r"spec_config= configures speculative decoding and decoding='lookahead' "
                                         r"would ignore it; pass lookahead_config="):
        llama.generate(prompt, decoding="lookahead", spec_config=hf_specdec.SpecConfig(), max_new_tokens=NEW)


def test_lookahead_config_with_speculative_is_refused(llama, prompt):
    with pytest.raises(ValueError, match=r"lookahead_config= configures decoding='lookahead' and speculative "
                                         r"decoding would ignore it; pass spec_config="):
        llama.generate(prompt, assistant_model=llama, lookahead_config=hf_specdec.LookaheadConfig(),
                       max_new_tokens=NEW)


# -- output flags ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{}, dict(repetition_penalty=1.3)], ids=["raw", "repetition_penalty"])
@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_output_logits_equal_plain_generate(llama, prompt, mode, kwargs):
    """Raw logits (before processors), one row per emitted token, as plain generate returns them, with guesses
    accepted; scores alongside stay the processed ones."""
    flags = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True,
                 output_scores=True, **kwargs)
    expected = type(llama).generate(llama, prompt, **flags)
    routed = modes(llama)[mode]
    out = llama.generate(prompt, **flags, **routed)
    assert torch.equal(out.sequences, expected.sequences)
    assert out.spec_stats.accepted > 0, out.spec_stats
    assert len(out.logits) == len(expected.logits) == NEW
    assert all(row.dtype == torch.float32 and row.shape == (1, 96) for row in out.logits)
    assert torch.allclose(torch.cat(out.logits), torch.cat(expected.logits), atol=1e-4)
    assert torch.allclose(torch.cat(out.scores), torch.cat(expected.scores), atol=1e-4)
    if kwargs:
        assert not torch.allclose(torch.cat(out.logits), torch.cat(out.scores))


# -- refused before generate() runs anything ------------------------------------------------------------------------
class CountAllForwards:
    """Counts every module forward anywhere (an image encoder or a text encoder run by generate() included)."""

    def __init__(self):
        self.count = 0

    def __call__(self, module, args):
        self.count += 1

    def __enter__(self):
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def test_a_typo_is_left_to_generates_own_validation(llama, prompt):
    with pytest.raises(ValueError, match=r"The following `model_kwargs` are not used by the model: \['atention_mask'\]"):
        llama.generate(prompt, atention_mask=torch.ones_like(prompt), max_new_tokens=4, decoding="lookahead")


def _tiny_blt():
    """transformers' BLT tester's config (patching off: one patch per byte)."""
    from transformers import BltConfig, BltForCausalLM

    part = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                intermediate_size=32, max_position_embeddings=32, rope_parameters={"rope_type": "default"},
                hidden_act="silu", rms_norm_eps=1e-5, dropout=0.0)
    config = BltConfig(vocab_size=32, max_position_embeddings=32, patch_in_forward=False, patch_size=4,
                       patching_mode="entropy", max_patch_length=None, cross_attn_k=2,
                       encoder_hash_byte_group_size=[2, 3], encoder_hash_byte_group_vocab=64,
                       encoder_hash_byte_group_nb_functions=1, patcher_config=part, encoder_config=part,
                       decoder_config=dict(part, vocab_size=32, hidden_size_global=32),
                       global_config=dict(part, hidden_size=32), tie_word_embeddings=False)
    config.num_attention_heads, config.num_hidden_layers, config.hidden_size = 2, 1, 16
    torch.manual_seed(0)
    return BltForCausalLM(config).eval()


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_blt_is_refused_before_any_forward_for_its_forward_over_new_tokens_is_not_its_steps(mode):
    """BLT's forward over several new tokens on a cache gives other tokens than its one-token steps (a token's
    hash embedding reads the tokens before it in the forward, and its global transformer keeps no cache), so no
    guess can be verified exactly: refused in both modes, before any forward, with the reason."""
    blt = _tiny_blt()
    prompt = torch.randint(1, 32, (2, 7), generator=torch.Generator().manual_seed(0))
    out = type(blt).generate(blt, prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cache = blt(prompt, use_cache=True).cache
        together = blt(out[:, 7:-1], cache=cache, use_cache=True).logits.argmax(-1)
    assert not torch.equal(together, out[:, 8:])  # plain's steps chose other tokens than the forward over them
    hf_specdec.enable(blt)
    routed = dict(assistant_model=copy.deepcopy(blt)) if mode == "speculative" else dict(decoding="lookahead")
    with CountAllForwards() as forwards, pytest.raises(
            hf_specdec.support.Unsupported, match=rf"cannot run BltForCausalLM \(blt\) with decoding='{mode}': its "
                                                  r"forward over several new tokens differs from its one-token "
                                                  r"steps \(a token's byte-group hash embedding"):
        blt.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, **routed)
    assert forwards.count == 0
