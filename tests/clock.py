"""Injected costs: a virtual clock that only model forwards advance, so that what a policy measures is chosen by
the test and not by the CPU it runs on.

hf_specdec times every round with ``time.perf_counter`` (the loop, each drafter) and sizes rounds from those
timings. ``VirtualClock`` replaces that clock in those modules with one that stands still except when a charged
model runs a forward, which advances it by ``seconds(n)`` for a forward over n new tokens. A test then sets
t(n) of the target and t_d of the draft exactly (flat, steep, a slow draft), and every decision, hence every
random draw a sampled run makes, is the same on every machine.

    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, target, lambda n: 1.0)   # t(n) = 1 s for any n: verifying is free
    clock.charge(monkeypatch, draft, lambda n: 0.5)    # a draft step costs half a target step
"""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace
from typing import Callable

# every module of hf_specdec that reads time.perf_counter() to time a round (tests/test_clock.py checks the list
# against the modules that call it; those whose clock decides nothing in a round are listed there, with why)
TIMED_MODULES = (
    "hf_specdec.loop",
    "hf_specdec.drafters.base",
    "hf_specdec.drafters.draft_model",
    "hf_specdec.drafters.draft_tree",  # a tree's draft forwards by width: the planner's draft step per width
    "hf_specdec.drafters.lookahead",
    "hf_specdec.drafters.prompt_lookup",
)


class VirtualClock:
    def __init__(self, monkeypatch) -> None:
        self.now = 0.0
        self.forwards: list[tuple[str, int]] = []  # (name, new tokens) of every charged forward, in order
        fake_time = SimpleNamespace(perf_counter=lambda: self.now)
        for name in TIMED_MODULES:
            module = importlib.import_module(name)
            assert hasattr(module, "time"), f"{name} no longer imports time: update TIMED_MODULES"
            monkeypatch.setattr(module, "time", fake_time)

    def charge(self, monkeypatch, model, seconds: Callable[[int], float], name: str = "model") -> None:
        """Every forward of ``model`` advances the clock by ``seconds(number of new tokens)``."""
        forward = model.forward

        @functools.wraps(forward)  # its signature: transformers passes the inputs a forward names (position_ids)
        def timed_forward(*args, **kwargs):
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            num_tokens = int(input_ids.shape[1])
            self.forwards.append((name, num_tokens))
            self.now += seconds(num_tokens)
            return forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", timed_forward)


def greedy_parity_drafting(monkeypatch, target, draft, prompt, config, new_tokens: int):
    """Greedy ``speculative_generate`` of ``target`` with ``draft`` under flat target forwards of 1 s and draft steps
    of 0.05 s (so the adaptive policy drafts on any machine): asserts it equals plain greedy ``generate`` of the
    target and that the draft's own layers drafted tokens the target kept; returns the call's stats."""
    import torch

    import hf_specdec

    calls = []
    draft.model.layers[0].mlp.up_proj.register_forward_hook(lambda *args: calls.append(1))
    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, target, lambda n: 1.0, name="target")
    clock.charge(monkeypatch, draft, lambda n: 0.05, name="draft")
    expected = type(target).generate(target, prompt, max_new_tokens=new_tokens, do_sample=False)
    out = target.generate(prompt, custom_generate=hf_specdec.speculative_generate, draft_model=draft,
                          spec_config=config, max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(out, expected)
    stats = target.last_spec_stats.get()
    drafted, accepted = stats.drafted - stats.lookup_drafted, stats.accepted - stats.lookup_accepted  # the model's
    assert drafted > 0 and 0 < accepted <= drafted and calls, (drafted, accepted)  # the draft's layers drafted
    assert any(name == "draft" for name, _ in clock.forwards)
    return stats
