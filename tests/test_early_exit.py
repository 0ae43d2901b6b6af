"""Early-exit self-drafting (``drafters/early_exit.py``): the target's first N layers draft for it.

The view runs exactly the target's first N layers, final norm and output layer on the target's own tensors; through
``generate(..., assistant_early_exit=N)`` the output is plain greedy's (fp32), for one prompt and a left-padded
batch, with full and with partial acceptance; out-of-range N and models that cannot be cut are refused with the
reason; "auto" tries the depths and keeps the one the planner prices best. Costs are injected (``tests/clock.py``: a target forward 1 s, a draft step 0.025 s per layer), so the adaptive policy
drafts on any machine and every parity test provably drafts. The sampled distribution is tested in
``tests/test_sampling.py`` (``test_speculative_early_exit_draft`` and its negative control).
"""

from __future__ import annotations

import pytest
import torch

import hf_specdec
from hf_specdec.drafters import early_exit
from hf_specdec.drafters.early_exit import EarlyExit, EarlyExitUnsupported, early_exit_model
from tests.clock import VirtualClock
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LAYERS = 4
NEW = 32
PROMPT = torch.tensor([[5, 17, 42, 8, 23, 61, 2, 9]])


def shallow_tail(model, keep: int, scale: float = 0.05):
    """``model`` with the output projections of its layers past ``keep`` scaled by ``scale``: those layers add
    little, so its first ``keep`` layers predict what it predicts (a model trained for early exit, in miniature)."""
    base = getattr(model, model.base_model_prefix)
    with torch.no_grad():
        for layer in list(early_exit.decoder_layers(model)[1])[keep:]:
            for name, parameter in layer.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight", "c_proj.weight")):
                    parameter.mul_(scale)
    del base
    return model


@pytest.fixture(scope="module")
def random_target():
    """Random weights: its first layers rarely agree with all four (partial acceptance)."""
    return tiny_model("llama", seed=0, num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def early_target():
    """Layers 3 and 4 add little: its first two layers mostly agree with it."""
    return shallow_tail(tiny_model("llama", seed=2, num_hidden_layers=LAYERS), keep=2)


@pytest.fixture
def costs(monkeypatch):
    """``costs(target)``: injected costs, every forward of ``target`` 1 s and every forward of an early-exit view
    0.025 s per layer it runs (each view is charged as ``EarlyExit.view`` makes it); returns the clock."""
    clock = VirtualClock(monkeypatch)
    make = early_exit.early_exit_model
    step = {"seconds": lambda model, layers: 0.025 * layers}

    def charged_view(model, layers):
        view = make(model, layers)
        seconds = step["seconds"](model, layers)
        clock.charge(monkeypatch, view, lambda n: seconds, name=f"early_exit_{layers}")
        return view

    monkeypatch.setattr(early_exit, "early_exit_model", charged_view)

    def charge(target, view_seconds=None):
        """``view_seconds(target, layers)``: a view's step instead of 0.025 s per layer."""
        clock.charge(monkeypatch, target, lambda n: 1.0, name="target")
        if view_seconds is not None:
            step["seconds"] = view_seconds
        return clock

    return charge


def plain(model, ids, **kwargs):
    return type(model).generate(model, ids, max_new_tokens=NEW, do_sample=False, **kwargs)


def enabled(model):
    """``model`` with hf_specdec enabled and a fresh speculative memory (no estimates from another test)."""
    hf_specdec.enable(model)
    model.speculative_memory.clear()
    return model


# -- the view ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_view_runs_the_first_layers_on_the_targets_own_tensors(arch):
    overrides = {"n_layer": LAYERS} if arch == "gpt2" else {"num_hidden_layers": LAYERS}
    target = tiny_model(arch, seed=3, **overrides)
    before = {name: parameter.clone() for name, parameter in target.named_parameters()}
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    for layers in (1, 3):
        draft = early_exit_model(target, layers)
        with torch.no_grad():
            hidden = target(ids, output_hidden_states=True).hidden_states[layers]  # after layer `layers`
            base = getattr(target, target.base_model_prefix)
            norm = base.ln_f if arch == "gpt2" else base.norm
            assert torch.equal(draft(ids).logits, target.lm_head(norm(hidden)))
        target_tensors = {id(t) for t in [*target.parameters(), *target.buffers()]}
        assert all(id(t) in target_tensors for t in [*draft.parameters(), *draft.buffers()])  # no copies
        assert sum(p.numel() for p in draft.parameters()) < sum(p.numel() for p in target.parameters())
        assert draft.config.num_hidden_layers == layers
    assert target.config.num_hidden_layers == LAYERS  # the target is untouched
    assert len(early_exit.decoder_layers(target)[1]) == LAYERS
    assert all(torch.equal(parameter, before[name]) for name, parameter in target.named_parameters())


# -- parity -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_greedy_parity_through_enable(early_target, layers, costs):
    clock = costs(early_target)
    expected = plain(early_target, PROMPT)
    model = enabled(early_target)
    out = model.generate(PROMPT, assistant_early_exit=layers, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    stats = model.last_spec_stats.get()
    assert stats.drafted - stats.lookup_drafted > 0 and stats.accepted - stats.lookup_accepted > 0, stats.round_log
    drafts = [tokens for name, tokens in clock.forwards if name == f"early_exit_{layers}"]
    assert drafts and set(drafts) == {1}  # the view drafted, one token a step: it never read the prompt
    assert stats.draft_setup_time_s == 0 and stats.draft_cache_bytes == 0  # it borrowed the target's cache
    if layers == 2:  # the layers after the second add little: most of what the first two draft is accepted
        assert stats.accepted - stats.lookup_accepted > 0.5 * (stats.drafted - stats.lookup_drafted)


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_greedy_parity_other_architectures(arch, costs):
    overrides = {"n_layer": LAYERS} if arch == "gpt2" else {"num_hidden_layers": LAYERS}
    target = shallow_tail(tiny_model(arch, seed=2, **overrides), keep=2)
    costs(target)
    expected = plain(target, PROMPT)
    out = enabled(target).generate(PROMPT, assistant_early_exit=2, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    assert target.last_spec_stats.accepted - target.last_spec_stats.lookup_accepted > 0


def test_sliding_window_layers_are_not_lent_the_draft_reads_the_prompt(costs):
    """Mistral's sliding-window layers keep a state of their own: the view reads the prompt into a cache of its own
    (as any draft model) and the output is still plain greedy's, past the window."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(2)
    target = shallow_tail(MistralForCausalLM(MistralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, sliding_window=6, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)).eval(), keep=2)
    clock = costs(target)
    expected = plain(target, PROMPT)
    out = enabled(target).generate(PROMPT, assistant_early_exit=2, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    stats = target.last_spec_stats.get()
    assert stats.accepted - stats.lookup_accepted > 0
    reads = [tokens for name, tokens in clock.forwards if name == "early_exit_2" and tokens > 1]
    assert reads and reads[0] >= PROMPT.shape[1] - 1  # it read the committed tokens when it first drafted


def test_partial_acceptance_on_a_random_target(random_target, costs):
    """Random layers: the first two agree with all four now and then, so rounds are rejected part-way and the
    draft's cache rolls back; the fixed policy drafts every round."""
    costs(random_target)
    expected = plain(random_target, PROMPT)
    model = enabled(random_target)
    out = model.generate(PROMPT, assistant_early_exit=2, max_new_tokens=NEW, do_sample=False,
                         spec_config=hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=4, history_lookup=False))
    assert torch.equal(out, expected)
    stats = model.last_spec_stats.get()
    assert 0 < stats.accepted < stats.drafted / 2, (stats.accepted, stats.drafted)


def test_batch_left_padded_parity(early_target, costs):
    costs(early_target)
    ids = torch.tensor([[0, 0, 0, 5, 17, 42, 8, 23], [3, 4, 5, 6, 7, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
    expected = plain(early_target, ids, attention_mask=mask, pad_token_id=0)
    model = enabled(early_target)
    out = model.generate(ids, attention_mask=mask, assistant_early_exit=2, max_new_tokens=NEW, do_sample=False,
                         pad_token_id=0)
    assert torch.equal(out, expected)
    stats = model.last_spec_stats.get()
    assert stats.rows == 2 and stats.accepted - stats.lookup_accepted > 0


def test_custom_generate_and_generation_config_routes(early_target, costs):
    """``draft_model=EarlyExit(N)`` without enable, and ``assistant_early_exit`` set in a generation config."""
    from transformers import GenerationConfig

    costs(early_target)
    expected = plain(early_target, PROMPT)
    out = early_target.generate(PROMPT, custom_generate=hf_specdec.speculative_generate, draft_model=EarlyExit(2),
                                max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    stats = early_target.last_spec_stats.get()  # the view's own tokens (not prompt lookup's) drafted and kept
    assert stats.drafted - stats.lookup_drafted > 0 and stats.accepted - stats.lookup_accepted > 0
    config = GenerationConfig(assistant_early_exit=2, max_new_tokens=NEW, do_sample=False)
    out = enabled(early_target).generate(PROMPT, generation_config=config)
    assert torch.equal(out, expected)
    stats = early_target.last_spec_stats.get()
    assert stats is not None and stats.drafted - stats.lookup_drafted > 0 and stats.accepted - stats.lookup_accepted > 0


def test_memory_keeps_one_estimate_per_exit_layer(early_target, costs):
    costs(early_target)
    model = enabled(early_target)
    for _ in range(2):
        model.generate(PROMPT, assistant_early_exit=2, max_new_tokens=8, do_sample=False)
    model.generate(PROMPT, assistant_early_exit=3, max_new_tokens=8, do_sample=False)
    two, three = model.speculative_memory.estimates(EarlyExit(2)), model.speculative_memory.estimates(EarlyExit(3))
    assert two is model.speculative_memory.estimates(EarlyExit(2)) and two is not three  # a stable key, by value
    assert two.draft_step.largest and three.draft_step.largest  # each measured its own draft step
    assert two.draft_seconds(1) == pytest.approx(0.05)  # the injected step of the view: 2 layers


# -- "auto" -----------------------------------------------------------------------------------------------------------
def test_auto_tries_the_depths_then_keeps_the_one_that_pays(costs):
    """Eight layers, the last six adding little: depth 1 of 8 rarely agrees, depth 2 mostly does, and a step
    costs the view's share of the weights (``layer_share``: what "auto" assumes before it measured one). "auto"
    takes the cheapest depth first (every depth at the prior), then the next after depth 1 measured poorly, then
    stays at depth 2 (deeper ones cost more, and their prior is below what depth 2 kept): the outputs are plain
    greedy's throughout."""
    target = shallow_tail(tiny_model("llama", seed=2, num_hidden_layers=8), keep=2)
    clock = costs(target, view_seconds=lambda model, layers: early_exit.layer_share(model, layers))
    expected = plain(target, PROMPT)
    model = enabled(target)
    chosen = []
    for _ in range(3):
        start = len(clock.forwards)
        out = model.generate(PROMPT, assistant_early_exit="auto", max_new_tokens=16, do_sample=False)
        assert torch.equal(out, expected[:, : PROMPT.shape[1] + 16])
        chosen.append({name for name, _ in clock.forwards[start:]} - {"target"})
    assert chosen == [{"early_exit_1"}, {"early_exit_2"}, {"early_exit_2"}], chosen
    choice = early_exit.choose_layers(model, model.speculative_memory)
    assert choice.layers == 2 and choice.measured == {1, 2}
    assert choice.rates[2] > choice.rates[1]


def test_auto_without_a_memory_takes_the_shallowest(random_target, costs):
    clock = costs(random_target)
    out = random_target.generate(PROMPT, custom_generate=hf_specdec.speculative_generate,
                                 draft_model=EarlyExit("auto"), max_new_tokens=8, do_sample=False)
    assert torch.equal(out, type(random_target).generate(random_target, PROMPT, max_new_tokens=8, do_sample=False))
    assert {name for name, _ in clock.forwards} == {"target", "early_exit_1"}


# -- refusals ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers", [4, 9])
def test_out_of_range_is_refused_with_the_range(random_target, layers):
    with pytest.raises(ValueError) as error:
        enabled(random_target).generate(PROMPT, assistant_early_exit=layers, max_new_tokens=4)
    assert str(error.value) == (f"assistant_early_exit={layers} is out of range: this llama model has 4 decoder "
                                "layers, so the draft can run 1 to 3 of them.")


@pytest.mark.parametrize("layers", [0, -1, 2.5, True, "8"])
def test_not_a_layer_count_is_refused(random_target, layers):
    with pytest.raises(ValueError) as error:
        enabled(random_target).generate(PROMPT, assistant_early_exit=layers, max_new_tokens=4)
    assert str(error.value) == (f"assistant_early_exit={layers!r} is invalid: use an int >= 1, the number of the "
                                "target's decoder layers the draft runs, or 'auto'.")


@pytest.mark.parametrize("layers", [1, "auto"])
def test_a_one_layer_target_is_refused(layers):
    with pytest.raises(ValueError) as error:
        enabled(tiny_model("llama", seed=0, num_hidden_layers=1)).generate(PROMPT, assistant_early_exit=layers,
                                                                           max_new_tokens=4)
    assert str(error.value) == "assistant_early_exit needs a target of 2 or more decoder layers; this llama model has 1."


def test_conflicting_arguments_are_refused(random_target):
    model = enabled(random_target)
    with pytest.raises(ValueError) as error:
        model.generate(PROMPT, assistant_early_exit=2, assistant_model=random_target, max_new_tokens=4)
    assert str(error.value) == ("assistant_early_exit= drafts with the model's own first layers and would ignore "
                                "assistant_model=; pass one of them.")
    with pytest.raises(ValueError) as error:
        model.generate(PROMPT, assistant_early_exit=2, decoding="lookahead", max_new_tokens=4)
    assert str(error.value) == ("assistant_early_exit= is a draft for speculative decoding and decoding='lookahead' "
                                "would ignore it; drop one of them.")


def test_a_model_without_one_layer_list_is_refused_by_name():
    from transformers import OPTConfig, OPTForCausalLM

    model = OPTForCausalLM(OPTConfig(vocab_size=96, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                     num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=32))
    with pytest.raises(EarlyExitUnsupported) as error:
        enabled(model.eval()).generate(PROMPT, assistant_early_exit=1, max_new_tokens=4)
    assert str(error.value) == (
        "hf_specdec cannot draft with the first layers of OPTForCausalLM (opt): its decoder layers are not one list "
        "of config.num_hidden_layers = 2 layers (looked for layers, h, blocks). Use assistant_model=<a small draft "
        "model> or decoding='lookahead' for this model.")


def test_refusals_come_before_any_forward(random_target, monkeypatch):
    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, random_target, lambda n: 1.0)
    with pytest.raises(ValueError):
        enabled(random_target).generate(PROMPT, assistant_early_exit=7, max_new_tokens=4)
    assert clock.forwards == []
