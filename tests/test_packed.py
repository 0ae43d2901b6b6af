"""The "fp32-packed" format (hf_specdec.models.packed): the layer computes what ``F.linear`` computes, each row
independently of the rows beside it; loading, the profile and the choice know the format; a packed model
copies, counts and saves as the dense one; and a packed target or draft never changes greedy output (fp32, tiny
models, provably drafting)."""

import copy

import pytest
import torch

import hf_specdec
from hf_specdec.integration import compute_share
from hf_specdec.models import choose as C
from hf_specdec.models import formats as F
from hf_specdec.models import hardware, loading, packed
from hf_specdec.models import measure as M
from hf_specdec.models import profile as P
from hf_specdec.models.tiny import tiny_model_dir
from tests.clock import greedy_parity_drafting
from tests.conftest import perturbed_copy, tiny_model

pytestmark = pytest.mark.skipif(not packed.packed_available(), reason="this torch has no oneDNN")

NEW = 48


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_is_the_linear_and_each_row_is_independent_of_the_others(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=bias).eval()
    layer = packed.PackedLinear(linear)
    assert layer.weight is None and layer.reordered.layout == torch._mkldnn
    x = torch.randn(2, 9, 96)
    with torch.no_grad():
        out = layer(x)
        torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)
        for rows in (1, 3, 5):  # a row's result whatever the number of rows computed with it
            assert torch.equal(layer(x[0, :rows])[0], out[0, 0])
        assert layer(x[:, ::2]).shape == (2, 5, 200)  # a non-contiguous input


def test_pack_linears_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match=r"fp32-packed takes an fp32 model on the CPU, got torch.bfloat16 on cpu"):
        packed.pack_linears(tiny_model("llama").to(torch.bfloat16))


def test_a_packed_model_copies_counts_and_saves_as_the_dense_one(target, prompt):
    model = copy.deepcopy(target)
    draft = perturbed_copy(target, scale=0.02)
    dense_state = {k: v.clone() for k, v in model.state_dict().items()}
    share, footprint = compute_share(draft, model), hardware.footprint_bytes(model)
    report = packed.pack_linears(model)
    assert report.packed[-1] == "lm_head" and F.model_format(model) == "fp32-packed"
    assert isinstance(model.lm_head, packed.PackedLinear) and model.lm_head.weight is not None  # the head keeps it
    state = model.state_dict()
    assert state.keys() == dense_state.keys() and all(torch.equal(state[k], dense_state[k]) for k in state)
    assert compute_share(draft, model) == share
    reordered = sum(m.reordered.numel() * 4 for m in model.modules() if isinstance(m, packed.PackedLinear))
    head_copy = model.lm_head.weight.numel() * 4  # the head's weight is kept (here untied: its own)
    assert hardware.footprint_bytes(model) == footprint - (reordered - head_copy) + reordered
    twin = copy.deepcopy(model)
    assert twin.model.layers[0].mlp.up_proj.reordered is model.model.layers[0].mlp.up_proj.reordered  # shared
    expected = plain(target, prompt)
    assert torch.equal(plain(model, prompt), expected) and torch.equal(plain(twin, prompt), expected)


def test_the_format_is_named_loaded_and_measured(tmp_path):
    assert F.format_load_args("fp32-packed") == (torch.float32, "fp32-packed")
    assert "fp32-packed" in F.candidate_formats("target") and "fp32-packed" in F.candidate_formats("draft")
    assert "fp32-packed" not in F.candidate_formats("target", "cuda")  # oneDNN's CPU kernel only
    assert hardware.quantization_config("fp32-packed") is None  # applied after loading
    path = tiny_model_dir(tmp_path)
    model, _, info = loading.load_model(str(path), quantize="fp32-packed")
    assert (info.dtype, info.quantize, F.model_format(model)) == ("float32", "fp32-packed", "fp32-packed")
    config = tiny_model("qwen2", num_hidden_layers=5, tie_word_embeddings=True).config
    cost = M.measure_format(config, "target", "fp32-packed", repeats=1)
    assert cost.format == "fp32-packed" and cost.method == "proxy" and cost.prefill_s > 0
    assert [n for n, _ in cost.step] == list(F.TARGET_SIZES)


def test_auto_loads_a_target_packed_when_it_measures_fastest(tmp_path):
    path = tiny_model_dir(tmp_path)
    profile = P.HardwareProfile.from_numbers({"bf16": {1: 0.9, 8: 4.0}, "fp32": {1: 0.6, 8: 2.6},
                                              "fp32-packed": {1: 0.5, 8: 0.75}})  # the AVX2 EPYC's shape
    assert C.choose_dtype(profile).value == "fp32-packed"
    model, _, info = loading.load_model(str(path), dtype="auto", profile=profile)
    assert (info.dtype, info.quantize, F.model_format(model)) == ("float32", "fp32-packed", "fp32-packed")
    assert info.why.startswith("fp32-packed: expected")
    slower = P.HardwareProfile.from_numbers({"bf16": {1: 0.2, 8: 0.21}, "fp32-packed": {1: 0.5, 8: 0.75}})
    assert C.choose_dtype(slower).value == "bf16"


def plain(model, prompt):
    return type(model).generate(model, prompt, max_new_tokens=NEW, do_sample=False)


@pytest.mark.parametrize("which", ["target", "draft", "both"])
def test_greedy_parity_with_packed_models(target, prompt, monkeypatch, which):
    """A packed copy of the fp32 target and/or a packed close copy as the draft; costs injected (tests/clock.py:
    flat target forwards of 1 s, a draft step of 0.05 s), so the adaptive policy drafts on any machine. The packed
    target's plain output is the reference (its own layers, as a user's plain call would run them)."""
    model = copy.deepcopy(target)
    draft = perturbed_copy(target, scale=0.02)
    if which in ("target", "both"):
        packed.pack_linears(model)
    if which in ("draft", "both"):
        packed.pack_linears(draft)
    greedy_parity_drafting(monkeypatch, model, draft, prompt, new_tokens=NEW,
                           config=hf_specdec.SpecConfig(num_draft_tokens=4, history_lookup=False))
