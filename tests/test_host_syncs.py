"""At most one device-to-host transfer per round at B = 1: the accept decision (issue 41).

On a GPU every read of a value the model computed (``.item()``, ``int()``, ``bool()``, ``.tolist()``, ``.cpu()``)
waits for the device to finish; a round that reads several stalls several times. This machine has no GPU, so "on
the device" is defined by taint: every tensor a model's forward returns (target and draft) is on the device, and so
is every tensor computed from one (or written into from one), until it is copied to the host (``.cpu()`` /
``.to("cpu")``: one transfer, after which it is a host tensor). Tensors the loop builds itself from Python values
(positions, masks, slot tables) are host tensors.

Two counters together catch every transfer, since on CPU ``tolist()`` and ``numpy()`` dispatch no aten op:

- a ``TorchFunctionMode`` propagates the taint through every torch call and counts ``tolist`` / ``numpy`` /
  ``cpu`` / ``to("cpu")`` of a tainted tensor (a ``to(device)`` with the model's ``torch.device`` moves a tensor to
  the device: on this machine that is the CPU too, and not a transfer);
- a ``TorchDispatchMode`` counts ``aten._local_scalar_dense`` (what ``item``, ``int``, ``float``, ``bool`` and
  ``__index__`` run) on a tainted tensor.

What a model does inside its own forward is the model's (plain ``generate`` runs the same code) and is not counted.
A round is one target forward: the transfers from the start of one target forward to the start of the next (its
verification, then the drafting of the next round) are that round's.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import hf_specdec
from tests.clock import VirtualClock
from tests.conftest import tiny_model

NEW = 40
TAINT = "_on_device"  # the marker attribute of a tensor "on the device"
TRANSFERS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}


def _tainted(value) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, TAINT, False)


def _taint(value) -> None:
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            setattr(leaf, TAINT, True)


def _to_host(func, args, kwargs) -> bool:
    """Is this ``Tensor.to`` call a copy to the host: ``to("cpu")``? (Here the model's device is the CPU too: a
    ``to(model_device)``, a ``torch.device``, is a move to the device, a no-op where the tensor is there already.)"""
    return func is torch.Tensor.to and any(value == "cpu" for value in (*args[1:], *kwargs.values())
                                           if isinstance(value, str))


class DeviceReads:
    """Counts transfers of device tensors to the host per round (module docstring), for the given models."""

    def __init__(self, target, drafts=()):
        self.inside = 0  # depth of model forwards running now
        self.rounds: list[int] = []  # per target forward: the transfers since it started
        self.before = 0  # transfers before the first target forward
        self.draft_steps: list[int] = []  # per target forward: the draft forwards since it started
        self.handles = []
        for model in (target, *drafts):
            modules = [model] + [getattr(model, model.base_model_prefix)]
            for module in modules:
                self.handles.append(module.register_forward_pre_hook(self._enter))
                self.handles.append(module.register_forward_hook(self._leave))
        self.handles.append(target.register_forward_pre_hook(self._round))
        for draft in drafts:
            self.handles.append(draft.register_forward_pre_hook(self._draft_step))

    def _round(self, module, args):
        if self.inside == 1:  # the target's own forward, not a draft borrowing it
            self.rounds.append(0)
            self.draft_steps.append(0)

    def _draft_step(self, module, args):
        if self.draft_steps:
            self.draft_steps[-1] += 1

    def _enter(self, module, args):
        self.inside += 1

    def _leave(self, module, args, output):
        self.inside -= 1
        _taint(output if not hasattr(output, "to_tuple") else output.to_tuple())

    def count(self) -> None:
        if self.inside:
            return
        if self.rounds:
            self.rounds[-1] += 1
        else:
            self.before += 1

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class _Functions(TorchFunctionMode):
    def __init__(self, reads: DeviceReads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.reads.inside:
            return out
        leaves = tree_flatten((args, kwargs))[0]
        if any(_tainted(leaf) for leaf in leaves):
            if func in TRANSFERS or _to_host(func, args, kwargs):
                self.reads.count()
                # a host copy, not tainted (on CPU, cpu() hands back the tensor itself: an alias stands for the copy)
                return out.detach() if out is args[0] else out
            if func is torch.Tensor.__setitem__ and _tainted(args[-1]):
                _taint(args[0])
            _taint(out)
        return out


class _Scalars(TorchDispatchMode):
    def __init__(self, reads: DeviceReads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and _tainted(args[0]):
            self.reads.count()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def device_reads(target, drafts=()):
    reads = DeviceReads(target, drafts)
    try:
        with _Functions(reads), _Scalars(reads):
            yield reads
    finally:
        reads.close()


def test_the_counter_sees_each_kind_of_read(target):
    """The counter itself: every kind of read of a model output counts once, host tensors never, a host copy is
    a host tensor."""
    prompt = torch.tensor([[5, 17, 42]])
    with torch.no_grad(), device_reads(target) as reads:
        logits = target(prompt).logits  # the prefill: round 1
        host = torch.arange(4)
        host.tolist(), int(host[0]), bool(host.any())  # host tensors: not counted
        choice = logits[0, -1].argmax()
        int(choice)
        choice.item()
        bool(choice > 3)
        logits[0, -1].tolist()
        copy = logits[0].cpu()
        copy.tolist(), int(copy.argmax())  # a host copy: free
        marked = torch.zeros(3, dtype=torch.long)
        marked[0] = choice  # written from a device value: on the device
        marked.tolist()
    assert reads.before == 0 and reads.rounds == [6]


def _paying(draft) -> hf_specdec.SpeculativeMemory:
    """Injected costs under which drafting clearly pays, so every case drafts on any machine."""
    memory = hf_specdec.SpeculativeMemory()
    memory.seed(draft, forward_seconds={n: 1.0 for n in range(1, 17)}, draft_step_seconds=0.01)
    return memory


# (spec_config, reads allowed per draft step): a fixed k reads nothing while drafting; the defaults' in-round
# rule (``confidence_stop``) decides after each draft step whether one more pays, from the draft's confidence in
# it: that step's one read (the token comes with it)
CASES = {
    "fixed_k4": ({"policy": "fixed", "num_draft_tokens": 4}, 0),
    "defaults_chain": ({"tree": "off"}, 1),
}


@pytest.fixture(scope="module")
def pair():
    """(target, draft): the draft is a copy of the target (it agrees on every token), a model of its own so that
    its forwards are told apart from the target's."""
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    return target, copy.deepcopy(target)


def _speculative(pair, prompt, spec, **kwargs):
    target, draft = pair
    with torch.no_grad(), device_reads(target, [draft]) as reads:
        out = target.generate(prompt, assistant_model=draft, spec_config=spec, speculative_memory=_paying(draft),
                              max_new_tokens=NEW, **kwargs)
    return out, reads


def _one_per_round(reads: DeviceReads, stats, per_draft_step: int = 0) -> None:
    assert reads.before == 0 and len(reads.rounds) == stats.forwards + 1  # the prefill, then one per round
    allowed = [1 + per_draft_step * steps for steps in reads.draft_steps]
    assert all(count <= most for count, most in zip(reads.rounds, allowed)), (reads.rounds, reads.draft_steps)


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_greedy_chain_reads_once_per_round(pair, prompt, case):
    target, _ = pair
    reference = type(target).generate(target, prompt, max_new_tokens=NEW, do_sample=False)
    spec, per_draft_step = CASES[case]
    out, reads = _speculative(pair, prompt, spec, do_sample=False)
    assert torch.equal(out, reference)
    stats = target.last_spec_stats.get()
    assert stats.accepted > 0 and not stats.tree_rounds
    _one_per_round(reads, stats, per_draft_step)


def test_where_reads_wait_for_the_device_the_defaults_chain_reads_once_per_round(pair, prompt, monkeypatch):
    """On a GPU a read waits for the device's queue (``costmodel.reads_wait``): the defaults' chain then has no
    in-round rule (no confidence stop, no lookup tail), its draft steps run on the device, and the round reads
    once. This machine has no GPU: the call is told its device's reads wait. On a virtual clock (forwards 1 s, draft
    steps 0.01 s, the host nothing), so that the defaults draft on any machine."""
    target, draft = pair
    monkeypatch.setattr(hf_specdec.integration, "reads_wait", lambda device: True)
    reference = type(target).generate(target, prompt, max_new_tokens=NEW, do_sample=False)
    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, target, lambda n: 1.0)
    clock.charge(monkeypatch, draft, lambda n: 0.01)
    out, reads = _speculative(pair, prompt, {"tree": "off"}, do_sample=False)
    assert torch.equal(out, reference)
    stats = target.last_spec_stats.get()
    model_drafted = stats.drafted - stats.lookup_drafted  # the draft model's tokens, not prompt lookup's
    assert stats.accepted > 0 and not stats.tree_rounds and model_drafted > stats.forwards  # chains of several
    _one_per_round(reads, stats)


def test_lookahead_greedy_reads_once_per_round(pair):
    target, _ = pair
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])
    reference = type(target).generate(target, prompt, max_new_tokens=NEW, do_sample=False)
    memory = hf_specdec.LookaheadMemory()
    memory.seed({n: 1.0 for n in range(1, 65)})  # flat forwards: guessing pays
    with torch.no_grad(), device_reads(target) as reads:
        out = target.generate(prompt, decoding="lookahead", lookahead_memory=memory, max_new_tokens=NEW,
                              do_sample=False)
    assert torch.equal(out, reference)
    stats = target.last_spec_stats.get()
    assert stats.accepted > 0
    _one_per_round(reads, stats)


def test_sampling_reads_are_reported(pair, prompt, capsys):
    """Sampling reads draft distributions and draws per node: reported, not asserted."""
    torch.manual_seed(0)
    _, reads = _speculative(pair, prompt, CASES["fixed_k4"][0], do_sample=True)
    with capsys.disabled():
        print(f"\nsampling, fixed k = 4: device-to-host transfers per round {reads.rounds}")
    assert reads.before == 0
