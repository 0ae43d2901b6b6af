"""Clear errors up front for what the loop cannot do, and validated configs."""

import pytest
import torch

import hf_specdec
from hf_specdec import LookaheadConfig, SpecConfig
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def model():
    return hf_specdec.enable(tiny_model("llama", seed=0))


def test_beam_search_through_the_callable(model, prompt):
    """Called directly (no route_generate to hand it to transformers), the callable refuses beams; through
    enable(model) they run transformers' beam search (tests/test_output_flags.py)."""
    with pytest.raises(ValueError, match=r"hf_specdec does not do beam search .* which runs transformers' beam"):
        model.generate(prompt, custom_generate=hf_specdec.speculative_generate, draft_model=model, num_beams=2,
                       max_new_tokens=3)


def test_offloaded_static_cache(model, prompt):
    """A static cache runs (tests/test_static_cache.py); an offloaded one is refused."""
    with pytest.raises(ValueError, match=r"got StaticCache \(offloaded\)\. .*Pass cache=DynamicCache"):
        model.generate(prompt, assistant_model=model, cache_implementation="offloaded_static", max_new_tokens=3)


def test_stop_strings_without_tokenizer(model, prompt):
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(prompt, assistant_model=model, stop_strings=["x"], max_new_tokens=3)


def test_unknown_decoding(model, prompt):
    with pytest.raises(ValueError, match="decoding='medusa'"):
        model.generate(prompt, decoding="medusa", max_new_tokens=3)


def test_mismatched_vocabularies(model, prompt):
    other = tiny_model("llama", seed=0, vocab=32)
    with pytest.raises(ValueError, match="hf-specdec check"):
        model.generate(prompt, assistant_model=other, max_new_tokens=3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(policy="greedy"), r"SpecConfig.policy='greedy' is invalid: choose one of \['adaptive', 'fixed', 'heuristic'\]"),
        (dict(num_draft_tokens=0), r"SpecConfig.num_draft_tokens=0 is invalid: use an int in \[1, 16\]"),
        (dict(num_draft_tokens=20), r"num_draft_tokens=20 is invalid"),
        (dict(max_draft_tokens=100), r"max_draft_tokens=100 is invalid: use an int in \[1, 64\]"),
        (dict(decay=0.1), r"decay=0.1 is invalid"),
        (dict(confidence_stop="yes"), r"confidence_stop='yes' is invalid: use True or False"),
    ],
)
def test_spec_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig(**kwargs)


def test_unknown_keys_are_refused():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['num_assistant_tokens'\]"):
        SpecConfig.from_dict({"num_assistant_tokens": 5})
    with pytest.raises(ValueError, match="unknown key"):
        LookaheadConfig.from_dict({"W": 5})


def test_configs_are_frozen():
    config = SpecConfig()
    with pytest.raises(Exception):
        config.policy = "fixed"


def test_spec_config_as_dict_through_generate(model, prompt):
    out = model.generate(prompt, assistant_model=model, max_new_tokens=5, spec_config={"policy": "fixed"})
    assert out.shape[1] == prompt.shape[1] + 5
    with pytest.raises(ValueError, match="unknown key"):
        model.generate(prompt, assistant_model=model, max_new_tokens=5, spec_config={"k": 3})
