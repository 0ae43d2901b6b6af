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
