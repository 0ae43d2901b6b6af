"""Every causal LM transformers ships: each hf_specdec mode is token-identical to plain greedy, or refused up front.

The sweep (tests/arch_sweep.py) builds a tiny random fp32 model per architecture, laid out as its published
checkpoints are (KV-shared layers in Gemma 3n and Gemma 4, the layer kinds of hybrid models), and decodes a
15-token prompt for 24 tokens with a sliding window of 8 (so sliding-window layers run past their window).
docs/architectures.md is its table (regenerate with `python tests/arch_sweep.py OUT.json --markdown
docs/architectures.md`). A kind of cache layer that gains a backend (hf_specdec/backends.py) turns its models from
refused to run here with nothing to change in the sweep.
"""

import pytest
import torch

from tests import arch_sweep

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def rows():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    try:
        return arch_sweep.run_sweep()
    finally:
        torch.set_num_threads(threads)


def test_no_architecture_crashes_or_differs(rows):
    bad = [(r["arch"], r["mode"], r["status"], r.get("error") or r.get("first_diff")) for r in rows
           if r["status"] in ("crash", "mismatch")]
    assert bad == [], bad


def test_refusals_come_before_any_forward_and_say_why(rows):
    refused = [r for r in rows if r["status"] == "refused"]
    assert refused, "the sweep must include models hf_specdec refuses (recurrent, ALiBi, no cache, ...)"
    for row in refused:
        assert row["forwards"] == 0, row
        ours = (("hf_specdec cannot run" in row["error"] and "Use " in row["error"])  # support.py: the architecture
                or ("hf_specdec does not pass" in row["error"] and "use plain generate()" in row["error"]))  # an input
        transformers_own = "model_kwargs` are not used by the model" in row["error"]  # generate() refused first
        assert ours or transformers_own, row["error"]


def test_the_families_that_matter_are_exact_past_the_sliding_window(rows):
    status = {(r["arch"], r["mode"]): r["status"] for r in rows}
    for arch in ("llama", "qwen2", "gpt2", "mistral", "gemma2", "gemma3_text", "phi3", "qwen3", "mixtral"):
        for mode in arch_sweep.MODES:
            assert status[(arch, mode)] == "exact", (arch, mode, status[(arch, mode)])
    # offset positions (RoBERTa-style), ALiBi and recurrent models: exact where possible, refused otherwise; ALiBi
    # (Bloom: no position ids, a bias of its own) reads no trie, so lookahead runs chains there
    assert status[("camembert", "lookahead")] == "exact"
    assert status[("bloom", "speculative_random")] == "exact" and status[("bloom", "lookahead")] == "exact"
    # recurrent and hybrid models (one state per row, restored per row): chains in both modes
    for arch in ("mamba", "falcon_h1", "jamba", "qwen3_next"):
        assert all(status[(arch, mode)] == "exact" for mode in arch_sweep.MODES), arch
    assert status[("openai-gpt", "speculative_self")] == "refused"


def test_kv_shared_and_indexed_models_run_as_their_checkpoints_are_laid_out(rows):
    """Gemma 3n and Gemma 4 with their last layers reading earlier layers' keys and values (the tiny configs have
    them: ``DummyLayer`` in the cache), and DSA models with indexer keys: exact in every mode."""
    by_arch = {(r["arch"], r["mode"]): r for r in rows}
    for arch in ("gemma3n_text", "gemma4_text", "gemma4"):
        assert "DummyLayer" in by_arch[(arch, "lookahead")]["cache_layers"], arch
    for arch in ("gemma3n_text", "gemma4_text", "gemma4", "deepseek_v32", "glm_moe_dsa"):
        for mode in arch_sweep.MODES:
            assert by_arch[(arch, mode)]["status"] == "exact", (arch, mode, by_arch[(arch, mode)].get("error"))


def test_architectures_that_cannot_be_built_are_listed_with_the_reason(rows):
    unbuildable = {r["arch"]: r["error"] for r in rows if r["status"] in ("unbuildable", "no_reference")}
    assert all(reason for reason in unbuildable.values())
    exercised = [r for r in rows if r["status"] == "exact" and r["mode"] != "lookahead"]
    assert sum(r.get("drafted", 0) > 0 for r in exercised) > 100  # the exact rows really drafted and rolled back
