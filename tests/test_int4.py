"""The "int4" draft format (hf_specdec.models.int4): the layer is close to the float one within its quantization
error, unsupported shapes stay in float and say why, loading / profile / choice know the format, and a draft in
int4 never changes greedy output (fp32, tiny models, provably drafting)."""

import logging

import pytest
import torch

import hf_specdec
from hf_specdec.models import choose as C
from hf_specdec.models import formats as F
from hf_specdec.models import hardware, int4, loading
from hf_specdec.models import measure as M
from hf_specdec.models import profile as P
from hf_specdec.models.tiny import tiny_model_dir
from tests.clock import greedy_parity_drafting
from tests.conftest import perturbed_copy, tiny_model

pytestmark = pytest.mark.skipif(not int4.int4_available(), reason="this torch has no int4 CPU kernel")

NEW = 48
BF16_EPS = 2.0 ** -8  # bf16 keeps 8 significant bits: relative rounding error <= 2^-8 per value



def _layer(in_features=256, out_features=96, bias=True, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=bias).eval()


def test_dequantized_weight_is_within_half_a_step_of_the_float_one():
    linear = _layer()
    q, sz = int4.quantize_groups(linear.weight, 32)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15 and sz.shape == (256 // 32, 96, 2)
    scale, zero = sz.float().transpose(0, 1).unbind(-1)  # [N, G]
    # half a step, plus what rounding scale (x 15) and zero to bf16 can add to a clamped extreme
    bound = (scale * (0.5 + 16 * BF16_EPS) + zero.abs() * BF16_EPS).repeat_interleave(32, dim=1)  # [N, K]
    error = (int4.dequantize(q, sz) - linear.weight.detach()).abs()
    assert bool((error <= bound).all()), float((error - bound).max())
    assert float(error.max()) > 0  # it is quantized: 16 levels cannot hold 32 random values exactly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_is_the_float_linear_up_to_quantization_error(dtype):
    linear = _layer().to(dtype)
    layer = int4.Int4Linear.from_linear(linear)
    x = torch.randn(2, 3, 256, dtype=dtype)
    with torch.no_grad():
        out, reference = layer(x), linear(x)
    assert out.shape == (2, 3, 96) and out.dtype == dtype
    q, sz = int4.quantize_groups(linear.weight, 32)
    dequantized = int4.dequantize(q, sz)
    rows = x.reshape(-1, 256).to(torch.bfloat16).float()  # what the kernel reads: bf16
    magnitude = rows.abs() @ dequantized.abs().T + linear.bias.float().abs()  # [6, 96]
    # the kernel computes rows @ dequantized.T in bf16 (rounded products/outputs), nothing more
    exact = rows @ dequantized.T + linear.bias.float()
    assert bool(((out.reshape(6, 96).float() - exact).abs() <= 4 * BF16_EPS * magnitude + 1e-6).all())
    # against the float layer: the weight error (half a step per weight, as above), x's rounding to bf16 and
    # the same bf16 slack
    scale = sz.float().transpose(0, 1)[..., 0].repeat_interleave(32, dim=1)  # [N, K]
    bound = x.reshape(-1, 256).float().abs() @ (scale * (0.5 + 16 * BF16_EPS)).T + 8 * BF16_EPS * magnitude
    assert bool(((out - reference).float().reshape(6, 96).abs() <= bound + 1e-6).all())


def test_int4_linear_without_bias_and_an_empty_batch():
    linear = _layer(64, 32, bias=False)
    layer = int4.Int4Linear.from_linear(linear, group_size=64)
    assert layer.bias is None and repr(layer) == "Int4Linear(in_features=64, out_features=32, group_size=64)"
    assert layer(torch.zeros(0, 64)).shape == (0, 32)
    assert [n for n, _ in layer.named_buffers()] == ["packed", "scales_and_zeros"]  # a model's .to() moves them


@pytest.mark.parametrize("shape,group,why", [
    ((40, 64), 32, "in_features 40 is not a multiple of the group size 32"),
    ((64, 72), 32, "out_features 72 is not a multiple of 16"),
    ((64, 64), 16, "group size 16 is not one of 32, 64, 128, 256"),
])
def test_unsupported_shapes_are_refused_with_the_reason(shape, group, why):
    with pytest.raises(ValueError) as err:
        int4.Int4Linear.from_linear(_layer(*shape), group_size=group)
    assert str(err.value) == f"Int4Linear({shape[0]} -> {shape[1]}): {why}; keep this layer in float"


def test_quantize_int4_keeps_unsupported_layers_in_float_and_says_so(caplog):
    model = tiny_model("llama", intermediate_size=72)  # gate/up: 72 outputs, down: 72 inputs
    with caplog.at_level(logging.WARNING, logger="hf_specdec.models.int4"):
        report = int4.quantize_int4(model)
    mlp, attention = model.model.layers[0].mlp, model.model.layers[0].self_attn
    assert type(mlp.up_proj) is torch.nn.Linear and type(mlp.down_proj) is torch.nn.Linear
    assert all(isinstance(getattr(attention, p), int4.Int4Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert type(model.lm_head) is torch.nn.Linear  # the output layer stays float unless asked
    assert report.quantized[:4] == tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkvo")
    assert len(report.quantized) == 8 and len(report.kept) == 6
    assert report.kept[0] == ("model.layers.0.mlp.gate_proj", "out_features 72 is not a multiple of 16")
    assert report.kept[2] == ("model.layers.0.mlp.down_proj", "in_features 72 is not a multiple of the group size 32")
    assert report.summary in caplog.text and "kept in float: model.layers.0.mlp.gate_proj" in report.summary
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 96)


def test_quantize_int4_refuses_a_model_it_cannot_change():
    with pytest.raises(ValueError, match=r"quantize='int4': no Linear layer of LlamaForCausalLM suits the int4 "
                                         r"kernel \(model.layers.0.self_attn.q_proj: in_features 40 is not"):
        int4.quantize_int4(tiny_model("llama", hidden_size=40, num_attention_heads=4, intermediate_size=80))


def test_a_tied_output_layer_gets_its_own_4bit_copy():
    model = tiny_model("qwen2", tie_word_embeddings=True)
    prompt = torch.tensor([[5, 17, 42, 8]])
    with torch.no_grad():
        before = model(prompt).logits
    embeddings = model.get_input_embeddings().weight.detach().clone()
    report = int4.quantize_int4(model, lm_head=True)
    assert report.quantized[-1] == "lm_head" and isinstance(model.lm_head, int4.Int4Linear) and report.lm_head
    assert torch.equal(model.get_input_embeddings().weight, embeddings)  # the embeddings keep their float values
    with torch.no_grad():
        after = model(prompt).logits
    assert after.shape == before.shape and float((after - before).abs().max()) < 0.1 * float(before.abs().max())


# ---------------------------------------------------------------------------------------------------------
# the format: names, loading, the profile, the choice


def test_the_format_is_named_loaded_and_measured(tmp_path):
    model = tiny_model("llama")
    int4.quantize_int4(model)
    assert F.model_format(model) == "int4" and F.as_format("int4") == "int4"
    assert F.format_load_args("int4") == (torch.bfloat16, "int4")
    assert "int4" in F.candidate_formats("draft") and "int4" not in F.candidate_formats("target")
    assert hardware.quantization_config("int4") is None  # applied after loading, GGUF files included
    assert F.FORMATS.index("dynamic-int8") < F.FORMATS.index("int4") < F.FORMATS.index("4bit")  # ties: before NF4

    path = tiny_model_dir(tmp_path)
    full = loading.load_model(str(path), dtype="bf16").model
    q, _, info = loading.load_model(str(path), quantize="int4")
    assert (info.dtype, info.quantize, info.choice) == ("bfloat16", "int4", None) and F.model_format(q) == "int4"
    assert isinstance(q.model.layers[0].mlp.up_proj, int4.Int4Linear) and type(q.lm_head) is torch.nn.Linear
    assert hardware.footprint_bytes(q) < hardware.footprint_bytes(full)
    with torch.no_grad():
        assert q(torch.tensor([[1, 5, 6]])).logits.shape == (1, 3, full.config.vocab_size)


def test_auto_chooses_int4_when_it_measures_fastest(tmp_path):
    path = tiny_model_dir(tmp_path)
    fast = P.HardwareProfile.from_numbers(draft={"fp32": 0.2, "bf16": 0.15, "dynamic-int8": 0.1, "int4": 0.08,
                                                 "4bit": 0.09})
    model, _, info = loading.load_model(str(path), quantize="auto", profile=fast)
    assert info.quantize == "int4" and info.choice.value == "int4" and F.model_format(model) == "int4"
    assert info.why.startswith("int4: one draft step 80.0 ms, the fastest here")
    # within 5% of NF4: the two are as fast, and int4 comes first in FORMATS
    tied = P.HardwareProfile.from_numbers(draft={"bf16": 0.2, "int4": 0.081, "4bit": 0.08})
    assert C.choose_draft_format(tied).value == "int4"
    slow = P.HardwareProfile.from_numbers(draft={"bf16": 0.05, "int4": 0.08})
    assert C.choose_draft_format(slow).value == "bf16"


def test_proxy_measurement_of_int4():
    config = tiny_model("qwen2", num_hidden_layers=5, tie_word_embeddings=True).config
    cost = M.measure_format(config, "draft", "int4", repeats=1, read_tokens=(8,))
    assert cost.format == "int4" and cost.method == "proxy" and [n for n, _ in cost.step] == list(F.DRAFT_SIZES)
    from transformers import AutoModelForCausalLM

    quantized = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # as load_model gets it: bf16
    quantized.tie_weights()
    int4.quantize_int4(quantized)
    assert cost.footprint_bytes == hardware.footprint_bytes(quantized)  # scaled from the proxies, exactly


# ---------------------------------------------------------------------------------------------------------
# exactness: the draft's format never changes the output


@pytest.mark.parametrize("draft_dtype,policy", [(torch.float32, "adaptive"), (torch.bfloat16, "fixed")])
def test_greedy_parity_with_an_int4_draft(target, prompt, monkeypatch, draft_dtype, policy):
    """fp32 target, its close copy quantized to int4 as the draft; costs injected (tests/clock.py: flat target
    forwards of 1 s, a draft step of 0.05 s), so the adaptive policy drafts on any machine."""
    draft = perturbed_copy(target, scale=0.02).to(draft_dtype)
    int4.quantize_int4(draft)
    assert F.model_format(draft) == "int4"
    greedy_parity_drafting(monkeypatch, target, draft, prompt, new_tokens=NEW, config=hf_specdec.SpecConfig(
        policy=policy, num_draft_tokens=4, history_lookup=False))
