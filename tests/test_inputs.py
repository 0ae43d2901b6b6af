"""Every input and flag generate() takes is carried as plain generate() carries it, or refused before any forward
with an error that names it and says what to do: nothing is dropped silently."""

import pytest
import torch
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

import hf_specdec
from tests.conftest import perturbed_copy, tiny_model

NEW = 24


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


class CountForwards:
    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.count += 1


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_token_type_ids_are_refused_before_any_forward(gpt2, prompt, mode):
    token_type_ids = torch.ones_like(prompt)
    plain = gpt2.generate(prompt, max_new_tokens=NEW, do_sample=False)
    typed = gpt2.generate(prompt, token_type_ids=token_type_ids, max_new_tokens=NEW, do_sample=False)
    assert not torch.equal(plain, typed)  # plain generate uses them: dropping them would change the output
    counter = CountForwards(gpt2)
    try:
        with pytest.raises(ValueError, match=r"hf_specdec does not pass token_type_ids to the model yet, so its "
                                             r"output would differ from plain generate\(\); drop it \(e\.g\. "
                                             r"tokenizer\(\.\.\., return_token_type_ids=False\)\) if your model "
                                             r"ignores it, or use plain generate\(\)\."):
            gpt2.generate(prompt, token_type_ids=token_type_ids, max_new_tokens=NEW, do_sample=False,
                          **modes(gpt2)[mode])
    finally:
        counter.handle.remove()
    assert counter.count == 0


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_what_generate_adds_for_a_text_model_is_not_refused(llama, gpt2, prompt, mode):
    for model in (llama, gpt2):
        mask = torch.ones_like(prompt)
        expected = type(model).generate(model, prompt, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **modes(model)[mode])
        assert torch.equal(out, expected)


@pytest.mark.parametrize("name", ["pixel_values", "image_sizes", "input_features", "image_patches"])
def test_other_model_inputs_are_refused_by_name(llama, prompt, name):
    draft = perturbed_copy(llama, 0.02)
    config = GenerationConfig(num_beams=1, num_return_sequences=1, do_sample=False, max_length=40, use_cache=True)
    calls = {hf_specdec.speculative_generate: {"draft_model": draft}, hf_specdec.lookahead_generate: {}}
    for callable_, extra in calls.items():
        with pytest.raises(ValueError, match=f"does not pass {name} to the model yet"):
            # through the callable (a multimodal model's generate would validate and forward these)
            callable_(llama, prompt, logits_processor=None, stopping_criteria=None, generation_config=config,
                      **extra, **{name: torch.zeros(1, 3)})


def test_position_ids_other_than_plain_generates_are_refused(llama, prompt):
    shifted = torch.arange(prompt.shape[1])[None] + 3
    with pytest.raises(ValueError, match="does not pass position_ids to the model yet"):
        llama.generate(prompt, position_ids=shifted, max_new_tokens=NEW, do_sample=False, decoding="lookahead")
    same = torch.arange(prompt.shape[1])[None]
    out = llama.generate(prompt, position_ids=same, max_new_tokens=NEW, do_sample=False, decoding="lookahead")
    assert torch.equal(out, type(llama).generate(llama, prompt, max_new_tokens=NEW, do_sample=False))


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
@pytest.mark.parametrize("flag", ["output_attentions", "output_hidden_states"])
@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_attentions_and_hidden_states_are_refused(llama, prompt, flag, mode):
    with pytest.raises(ValueError, match=rf"does not return per-step .* \({flag}=True\).* Drop {flag}=True"):
        llama.generate(prompt, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, **{flag: True},
                       **modes(llama)[mode])


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


IMAGE_TOKEN = 95


@pytest.fixture(scope="module")
def llava():
    """A tiny Llava: a 16x16 image is 4 patches, so 4 image tokens in the prompt."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=16, patch_size=8),
        text_config=LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
                                pad_token_id=None),
        image_token_id=IMAGE_TOKEN)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return hf_specdec.enable(model)


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_image_inputs_are_refused_by_their_name_before_the_image_is_encoded(llava, mode):
    prompt = torch.tensor([[IMAGE_TOKEN] * 4 + [5, 17, 42, 8]])
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        seen, blind = llava(input_ids=prompt, pixel_values=pixels).logits, llava(input_ids=prompt).logits
    assert not torch.allclose(seen, blind, atol=1e-3)  # the model reads the image: dropping it would change outputs
    with CountAllForwards() as forwards, pytest.raises(
            ValueError, match=r"hf_specdec does not pass pixel_values to the model yet, so its output would differ "
                              r"from plain generate\(\); drop it if your model ignores it, or use plain generate\(\)\."):
        llava.generate(prompt, pixel_values=pixels, max_new_tokens=8, do_sample=False, **modes(llava)[mode])
    assert forwards.count == 0  # generate() would have run the vision tower before a refusal from the callable


def test_image_inputs_generate_encoded_are_named_as_the_callers(llama, prompt):
    """Through the callable (no enable), generate() has already turned pixel_values into mm_encoder_outputs: the
    refusal names what the caller passed."""
    config = GenerationConfig(num_beams=1, num_return_sequences=1, do_sample=False, max_length=40, use_cache=True)
    with pytest.raises(ValueError, match=r"hf_specdec does not pass the image / video inputs \(pixel_values, \.\.\.\), "
                                         r"which generate\(\) encoded into mm_encoder_outputs, to the model yet.*; "
                                         r"drop them if your model ignores them, or use plain generate\(\)\."):
        hf_specdec.lookahead_generate(llama, prompt, logits_processor=None, stopping_criteria=None,
                                      generation_config=config, mm_encoder_outputs={"image": torch.zeros(1, 4, 64)})


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_an_encoder_decoder_model_is_refused_before_its_encoder_runs(prompt, mode):
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    bart = hf_specdec.enable(BartForConditionalGeneration(BartConfig(
        vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)).eval())
    routed = dict(assistant_model=bart) if mode == "speculative" else dict(decoding="lookahead")
    with CountAllForwards() as forwards, pytest.raises(
            hf_specdec.support.Unsupported, match=rf"cannot run BartForConditionalGeneration \(bart\) with "
                                                  rf"decoding='{mode}': it is an encoder-decoder model"):
        bart.generate(prompt, max_new_tokens=4, do_sample=False, **routed)
    assert forwards.count == 0  # generate() would have run the encoder before a refusal from the callable


def test_a_typo_is_left_to_generates_own_validation(llama, prompt):
    with pytest.raises(ValueError, match=r"The following `model_kwargs` are not used by the model: \['atention_mask'\]"):
        llama.generate(prompt, atention_mask=torch.ones_like(prompt), max_new_tokens=4, decoding="lookahead")
