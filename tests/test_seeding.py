"""The README's path starts from the cached hardware profile (issue 27): ``enable(model)`` then
``model.generate(..., assistant_model=draft)`` in a fresh process seeds the speculative memory once, from the
profile cache only (never measured, never raised), and the call's stats say where its first estimates came from.

Each test points ``$HF_SPECDEC_CACHE`` at its own temporary cache and writes the profile there through the store
(``get_profile`` with a given measurer: the keys a real ``hf-specdec tune`` writes). A virtual clock charges the
forwards what the profile says, so every decision is the same on every machine.
"""

from __future__ import annotations

import json

import pytest
import torch

import hf_specdec
from hf_specdec.memory import EstimatesFrom, LookaheadMemory, SpeculativeMemory
from hf_specdec.models import formats as F
from hf_specdec.models import profile as P
from hf_specdec.models import seeding
from hf_specdec.models import store as S
from hf_specdec.models.bundles import CACHE_ENV
from tests.clock import VirtualClock
from tests.conftest import perturbed_copy, tiny_model

NEW = 16
T_TARGET, T_DRAFT = 0.1, 0.005  # seconds: a flat t(n) and a cheap draft, as profiled and as charged


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """This test's own profile cache (the integration reads the default one: ``$HF_SPECDEC_CACHE``)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path


def profiled(config, role, fmt, device, weights=None) -> P.FormatCost:
    """What ``hf-specdec tune`` would have measured for the tiny pair: flat t(n), a draft step 1/20 of it, and the
    draft's prompt read a twentieth of the target's prefill."""
    if role == "target":
        return P.FormatCost(fmt, {n: T_TARGET for n in F.TARGET_SIZES}, 100, 100 * T_TARGET, method="given")
    return P.FormatCost(fmt, {rows: T_DRAFT for rows in F.DRAFT_SIZES}, method="given",
                        prompt_read={8: 8 * T_TARGET / 20, 64: 64 * T_TARGET / 20})


def write_profile(target, draft, cache_dir) -> None:
    S.get_profile(target, draft, cache_dir=cache_dir, target_formats=["fp32"], draft_formats=["fp32"],
                  measurer=profiled)


def pair(monkeypatch):
    """A fresh tiny target (enabled) and a close draft, both charged on one virtual clock."""
    model = tiny_model("llama", seed=0)
    draft = perturbed_copy(model, 0.02)
    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, model, lambda n: T_TARGET, name="target")
    clock.charge(monkeypatch, draft, lambda n: T_DRAFT, name="draft")
    return hf_specdec.enable(model), draft, clock


def first_round(clock) -> tuple[int, bool]:
    """(inputs of the first target forward after the prefill, whether the draft ran before it)."""
    later = clock.forwards[1:]
    index = next(i for i, (name, _) in enumerate(later) if name == "target")
    return later[index][1], any(name == "draft" for name, _ in later[:index])


def test_a_first_call_is_seeded_from_the_cached_profile_and_drafts_in_its_first_round(cache, monkeypatch, prompt):
    model, draft, clock = pair(monkeypatch)
    expected = type(model).generate(model, prompt, max_new_tokens=NEW, do_sample=False)
    write_profile(model, draft, cache)
    clock.forwards.clear()
    out = model.generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    stats = model.last_spec_stats.get()
    assert stats.estimates_from is EstimatesFrom.HARDWARE_PROFILE
    assert stats.estimates_why == ("seeded from the cached hardware profile: target t(n) in fp32 at 10 sizes (t(1) "
                                   "100.0 ms), draft step in fp32 5.0 ms (also over 2/4/8 rows), draft prompt read "
                                   "at 8/64 tokens, c = 0.05")
    inputs, drafted = first_round(clock)
    assert drafted and inputs > 1  # no plain step first: the draft ran, and the target verified its guesses
    assert stats.drafted > 0 and stats.accepted > 0 and "a plain step first" not in stats.plain_reasons
    assert model.speculative_memory.estimates(draft).draft_read.prior == pytest.approx(1 / 20)  # the profile's share
    assert "first estimates: hardware profile" in stats.summary()
    assert "first estimates: seeded from the cached hardware profile: target t(n) in fp32" in "\n".join(stats.explain())
    assert json.loads(json.dumps(stats.to_dict()))["estimates_from"] == "hardware profile"
    # the next call starts from what this one measured
    model.generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False)
    later = model.last_spec_stats.get()
    assert later.estimates_from is EstimatesFrom.EARLIER_CALLS
    assert later.estimates_why == ("measured by earlier calls on this memory (which started from the cached "
                                   "hardware profile)")


def test_without_a_cached_profile_a_first_call_starts_from_priors_as_before(cache, monkeypatch, prompt):
    model, draft, clock = pair(monkeypatch)
    expected = type(model).generate(model, prompt, max_new_tokens=NEW, do_sample=False)
    clock.forwards.clear()
    out = model.generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    stats = model.last_spec_stats.get()
    assert stats.estimates_from is EstimatesFrom.PRIORS
    assert stats.estimates_why == ("not seeded: no cached hardware profile of the target in fp32 or the draft in "
                                   "fp32 (hf-specdec tune, or load with dtype/quantize 'auto', measures it once)")
    assert first_round(clock) == (1, False)  # a plain step first, as before
    assert stats.plain_reasons["a plain step first"] == 1 and stats.drafted > 0
    assert "first estimates: priors (not seeded: no cached hardware profile" in "\n".join(stats.explain())
    assert not list(cache.rglob("*.json"))  # nothing was measured to seed it


def test_a_call_without_a_memory_starts_from_priors_and_reads_no_profile(cache, monkeypatch, prompt):
    model, draft, _ = pair(monkeypatch)
    write_profile(model, draft, cache)
    reads = count_profile_reads(monkeypatch)
    model.generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False, speculative_memory=None)
    stats = model.last_spec_stats.get()
    assert stats.estimates_from is EstimatesFrom.PRIORS and "speculative_memory=None" in stats.estimates_why
    assert reads == [] and not model.speculative_memory.holds(draft)


@pytest.mark.parametrize("damage", ["not UTF-8", "wrong types", "no directory"])
def test_a_damaged_profile_never_raises(cache, monkeypatch, prompt, damage):
    model, draft, _ = pair(monkeypatch)
    expected = type(model).generate(model, prompt, max_new_tokens=NEW, do_sample=False)
    write_profile(model, draft, cache)
    entries = sorted((cache / "profiles").glob("*.json"))
    assert [p.name.split("-")[0] for p in entries] == ["draft", "target"]
    if damage == "not UTF-8":
        for path in entries:
            path.write_bytes(b"\xff\xfe{\x00")
    elif damage == "wrong types":
        for path in entries:
            data = json.loads(path.read_text())
            path.write_text(json.dumps({**data, "cost": {**data["cost"], "step": [[1, "fast"]]}}))
    else:
        for path in entries:
            path.unlink()
        (cache / "profiles").rmdir()
        (cache / "profiles").write_text("a file where the folder was")
    out = model.generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    stats = model.last_spec_stats.get()
    assert stats.estimates_from is EstimatesFrom.PRIORS and stats.estimates_why.startswith("not seeded: ")
    assert stats.drafted > 0


def test_profile_seeding_turns_an_error_into_a_reason(monkeypatch):
    """Whatever reading the profile raises of the kinds a cache or a model can (here an OSError), the seeding
    runs on priors and says why."""
    def unreadable(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(seeding, "cached_profile", unreadable)
    record = seeding.profile_seeding(tiny_model("llama", seed=0))
    assert record.kind is EstimatesFrom.PRIORS and not record.seeded
    assert record.why == "not seeded: OSError: disk gone"


def count_profile_reads(monkeypatch) -> list:
    """Record every read of the profile cache the seeding makes."""
    reads, read = [], seeding.cached_profile

    def counted(*args, **kwargs):
        reads.append(args)
        return read(*args, **kwargs)

    monkeypatch.setattr(seeding, "cached_profile", counted)
    return reads


def test_a_memory_is_seeded_once_and_a_memory_that_holds_estimates_never(cache, monkeypatch, prompt):
    model, draft, _ = pair(monkeypatch)
    write_profile(model, draft, cache)
    reads = count_profile_reads(monkeypatch)
    # given costs: the profile is never read, the given seeds stand until measured (at the level measured here)
    given = {1: 0.3, 2: 0.3, 4: 0.3, 8: 0.3, 64: 0.9}
    model.speculative_memory.seed(draft, forward_seconds=given, draft_step_seconds=0.01)
    model.generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False)
    assert reads == [] and model.last_spec_stats.estimates_from is EstimatesFrom.GIVEN_COSTS
    forward = model.speculative_memory.estimates(draft).forward
    assert forward.measured(1) and not forward.seeded(1) and forward.estimate(1) == pytest.approx(T_TARGET)
    # t(64) = 3 t(1) as given, at the measured level (the profile's t(n) is flat)
    assert forward.seeded(64) and forward.estimate(64) == pytest.approx(3 * T_TARGET)
    # a fresh memory: read once on its first call, never on the next
    model.speculative_memory = SpeculativeMemory()
    for _ in range(2):
        model.generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False)
    assert len(reads) == 1 and model.last_spec_stats.estimates_from is EstimatesFrom.EARLIER_CALLS
    # a fresh memory the cache holds nothing for: read once too, then its calls measure
    model.speculative_memory = SpeculativeMemory()
    monkeypatch.setenv(CACHE_ENV, str(cache / "empty"))
    for _ in range(2):
        model.generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False)
    assert len(reads) == 2 and model.last_spec_stats.estimates_from is EstimatesFrom.EARLIER_CALLS
    assert "which started from priors" in model.last_spec_stats.estimates_why


def test_a_first_lookahead_call_gets_the_targets_t_n_from_the_cached_profile(cache, monkeypatch, prompt):
    model, draft, _ = pair(monkeypatch)
    expected = type(model).generate(model, prompt, max_new_tokens=NEW, do_sample=False)
    write_profile(model, None, cache)
    out = model.generate(prompt, decoding="lookahead", max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    stats = model.last_spec_stats.get()
    assert stats.estimates_from is EstimatesFrom.HARDWARE_PROFILE
    assert stats.estimates_why == ("seeded from the cached hardware profile: target t(n) in fp32 at 10 sizes "
                                   "(t(1) 100.0 ms)")
    assert model.lookahead_memory.estimates.forward.seeded(32)  # sizes no round measured keep the profile's price
    assert model.lookahead_memory.estimates.forward.estimate(32) == pytest.approx(T_TARGET)
    model.generate(prompt, decoding="lookahead", max_new_tokens=NEW, do_sample=False)
    assert model.last_spec_stats.estimates_from is EstimatesFrom.EARLIER_CALLS
    model.generate(prompt, decoding="lookahead", max_new_tokens=NEW, do_sample=False, lookahead_memory=None)
    assert model.last_spec_stats.estimates_from is EstimatesFrom.PRIORS


def test_the_harness_seeding_is_the_cores_and_the_call_reports_it(cache, monkeypatch, prompt):
    """``harness.seed_memory`` seeds through the same core function (from a given profile too); the first call
    on that memory reports the harness's seeding, and a cold lookahead memory the harness makes starts from
    the same t(n)."""
    from hf_specdec.harness import Harness

    model, draft, _ = pair(monkeypatch)
    given = P.HardwareProfile.from_numbers({"fp32": {1: 0.2, 2: 0.2, 4: 0.2}}, draft={"fp32": 0.01})
    with Harness(model, None, draft, profile=given) as harness:
        assert harness.memory_seed["kind"] == "hardware profile" and harness.memory_seed["seeded"]
        assert harness.cold_memory().origin.why == ("seeded from the given hardware profile: target t(n) in fp32 at "
                                                    "3 sizes (t(1) 200.0 ms)")
    model.generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False)
    stats = model.last_spec_stats.get()
    assert stats.estimates_from is EstimatesFrom.HARDWARE_PROFILE
    assert stats.estimates_why.startswith("seeded from the given hardware profile: target t(n) in fp32 at 3 sizes")
    assert LookaheadMemory().origin is None


def test_a_drafter_that_is_no_model_gets_the_targets_t_n_alone(cache, monkeypatch, prompt):
    """A bring-your-own ``Drafter`` (here prompt lookup) is no model the profile can hold: its memory gets the
    target's t(n), and the draft step is measured while decoding."""
    from hf_specdec.drafters.base import PerRow
    from hf_specdec.drafters.prompt_lookup import PromptLookupDrafter

    model, draft, _ = pair(monkeypatch)
    expected = type(model).generate(model, prompt, max_new_tokens=NEW, do_sample=False)
    write_profile(model, draft, cache)
    drafter = PerRow(PromptLookupDrafter)
    out = model.generate(prompt, assistant_model=drafter, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    assert model.last_spec_stats.estimates_why == ("seeded from the cached hardware profile: target t(n) in fp32 at "
                                                   "10 sizes (t(1) 100.0 ms)")
    assert model.speculative_memory.estimates(drafter).forward.seeded(32)
