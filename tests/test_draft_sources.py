"""Drafts through one protocol (issue 40): every draft argument becomes a ``DraftSource`` in one place
(``drafters/source.py``), and integration, the memory, the profile's seeding and the loop read only the source.

Pinned here: each kind's source (memory key, profile draft, model, drafter); a drafter of one's own without
``attach`` still drafts, and one with it is handed the target's cache; the early-exit drafter borrows the target's
cache through the protocol's ``attach``; the memory keys are what they were (the draft model, ``EarlyExit(N)``,
the drafter object), so earlier estimates and stored profiles still match; memory.py imports no drafter, and no
module tells drafters apart by ``hasattr``.
"""

from __future__ import annotations

import ast
import gc
import re
import weakref
from pathlib import Path

import pytest
import torch

import hf_specdec
from hf_specdec import cache as kv
from hf_specdec.config import LookaheadConfig
from hf_specdec.drafters.base import ChainDrafter, DraftCall, DraftKind, Drafter, PerRow
from hf_specdec.drafters.draft_model import DraftModelDrafter, DraftModelSource
from hf_specdec.drafters.early_exit import EarlyExit, EarlyExitDrafter, EarlyExitSource
from hf_specdec.drafters.lookahead import LookaheadSource
from hf_specdec.drafters.prompt_lookup import PromptLookupDrafter
from hf_specdec.drafters.source import OwnDrafterSource, ReadsNothing, draft_kind, draft_source
from hf_specdec.memory import LookaheadMemory, SpeculativeMemory
from hf_specdec.models import seeding
from tests.clock import VirtualClock
from tests.conftest import tiny_model
from tests.test_parity import ScriptedDrafter

PACKAGE = Path(hf_specdec.__file__).parent
NEW = 16


class ScriptedThatAttaches(ScriptedDrafter):
    """The same drafter of one's own, reading the target's cache: it is handed the target's store before its
    prefill."""

    attached = None

    def attach(self, cache) -> None:
        self.attached = cache


def call_of(target) -> DraftCall:
    return DraftCall(target, None, do_sample=False, vocab_size=int(target.config.vocab_size), history_lookup=True)


def plain(model, prompt, new=NEW):
    return type(model).generate(model, prompt, max_new_tokens=new, do_sample=False)


# -- one source per kind ----------------------------------------------------------------------------------------------
def test_each_draft_argument_has_its_source(target, close_draft):
    layered = tiny_model("llama", seed=0, num_hidden_layers=4)
    echo = ScriptedDrafter(torch.zeros(1, 1, dtype=torch.long), right=0, k=4)  # a drafter of one's own, no attach
    assert [draft_kind(d) for d in (close_draft, EarlyExit(2), echo, PerRow(PromptLookupDrafter))] == [
        DraftKind.MODEL, DraftKind.EARLY_EXIT, DraftKind.OWN, DraftKind.OWN]

    model = draft_source(close_draft, target)
    assert isinstance(model, DraftModelSource)
    assert model.memory_key is close_draft and model.profile_draft is close_draft and model.model is close_draft
    chain = model.drafter(call_of(target))
    assert isinstance(chain, ChainDrafter) and type(chain.model) is DraftModelDrafter and chain.lookup is not None

    early = draft_source(EarlyExit(2), layered, SpeculativeMemory())
    assert isinstance(early, EarlyExitSource)
    assert early.memory_key == EarlyExit(2) and early.profile_draft is None
    assert early.model.config.num_hidden_layers == 2 and layered.config.num_hidden_layers == 4
    assert type(early.drafter(call_of(layered)).model) is EarlyExitDrafter
    assert draft_source(EarlyExit("auto"), layered, SpeculativeMemory()).memory_key == EarlyExit(1)  # N decided

    own = draft_source(echo, target)
    assert isinstance(own, OwnDrafterSource)
    assert own.memory_key is echo and own.profile_draft is None and own.model is None
    wrapped = own.drafter(call_of(target))
    assert isinstance(wrapped, ReadsNothing) and wrapped.own is echo and isinstance(wrapped, Drafter)
    row_drafter = PerRow(PromptLookupDrafter)
    assert draft_source(row_drafter, target).drafter(call_of(target)) is row_drafter  # a whole Drafter: itself

    memory = LookaheadMemory()
    lookahead = LookaheadSource(LookaheadConfig(), memory, remember=True)
    assert lookahead.memory_key is None and lookahead.profile_draft is None and lookahead.model is None
    assert isinstance(lookahead.drafter(call_of(target)), PerRow)


def test_an_early_exit_out_of_range_is_refused_when_its_source_is_made(target):
    with pytest.raises(ValueError, match="out of range"):
        draft_source(EarlyExit(7), target)


# -- drafters of one's own --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", [ScriptedDrafter, ScriptedThatAttaches])
def test_a_drafter_of_ones_own_drafts_with_or_without_attach(drafter, prompt, monkeypatch):
    """CONTRACT.md's drafter (no ``attach``) runs as it did; one with ``attach`` is handed the target's store."""
    model = hf_specdec.enable(tiny_model("llama", seed=0))
    VirtualClock(monkeypatch).charge(monkeypatch, model, lambda n: 1.0, name="target")
    reference = plain(model, prompt, NEW + 16)
    own = drafter(reference, right=NEW + 16, k=4)  # every guess right
    out = model.generate(prompt, assistant_model=own, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, reference[:, : prompt.shape[1] + NEW])
    stats = model.last_spec_stats.get()
    assert stats.accepted > 0 and stats.accepted == sum(accepted for _, accepted in own.rounds), stats.round_log
    assert model.speculative_memory.holds(own)  # keyed by the object itself, as before
    if drafter is ScriptedThatAttaches:
        assert isinstance(own.attached, kv.KVStore)


# -- early exit reads the target's cache ------------------------------------------------------------------------------
def test_an_early_exit_draft_borrows_the_targets_cache(prompt, monkeypatch):
    target = tiny_model("llama", seed=2, num_hidden_layers=4)
    VirtualClock(monkeypatch).charge(monkeypatch, target, lambda n: 1.0, name="target")
    expected = plain(target, prompt)
    attached = []
    attach = EarlyExitDrafter.attach
    monkeypatch.setattr(EarlyExitDrafter, "attach", lambda self, cache: attached.append(self) or attach(self, cache))
    model = hf_specdec.enable(target)
    out = model.generate(prompt, assistant_early_exit=2, max_new_tokens=NEW, do_sample=False,
                         spec_config={"policy": "fixed", "num_draft_tokens": 3})
    assert torch.equal(out, expected)
    stats = model.last_spec_stats.get()
    assert stats.drafted - stats.lookup_drafted > 0, stats.round_log
    assert len(attached) == 1 and attached[0].borrows is False  # released at the end of the call
    assert stats.draft_setup_time_s == 0 and stats.draft_cache_bytes == 0  # no prompt read, no cache of its own


# -- memory keys ------------------------------------------------------------------------------------------------------
def test_memory_keys_are_the_draft_model_the_early_exit_value_and_the_drafter_object(target, close_draft):
    memory = SpeculativeMemory()
    assert draft_source(close_draft, target, memory).memory_key is close_draft
    assert draft_source(EarlyExit(2), tiny_model("llama", seed=0, num_hidden_layers=4), memory).memory_key == \
        EarlyExit(2)
    memory.seed(EarlyExit(2), {1: 0.1})
    assert memory.holds(EarlyExit(2)) and memory.estimates(EarlyExit(2)) is memory.estimates(EarlyExit(2))
    assert not memory.holds(EarlyExit(3))

    draft = tiny_model("llama", seed=5)
    gone = weakref.ref(draft)
    memory.seed(draft, {1: 0.1}, 0.01)
    assert memory.holds(draft)
    del draft
    gc.collect()
    assert gone() is None  # held weakly: the memory keeps no draft model alive


def test_the_profile_prices_a_draft_model_in_its_format_and_an_early_exit_as_the_target_alone():
    target = tiny_model("llama", seed=0, num_hidden_layers=4)
    memory = SpeculativeMemory()
    model = seeding.seed_speculative(memory, target, tiny_model("llama", seed=1))
    assert model.draft_format == "fp32" and "or the draft in fp32" in model.reason
    early = seeding.seed_speculative(memory, target, EarlyExit(2))
    assert early.draft_format is None and "draft" not in early.reason
    assert memory.origin(EarlyExit(2)) is early


# -- the import graph -------------------------------------------------------------------------------------------------
def test_memory_imports_no_drafter():
    tree = ast.parse((PACKAGE / "memory.py").read_text())
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert imported and not [name for name in imported if "drafters" in name], imported


def test_no_module_tells_drafters_apart_by_their_attributes():
    pattern = re.compile(r"""hasattr\([^)]*["'](propose|attach)["']""")
    found = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if pattern.search(path.read_text())]
    assert found == []
