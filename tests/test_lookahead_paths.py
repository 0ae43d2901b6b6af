"""Lookahead's paths beyond greedy parity: out of memory in a round, processors on trie rows, stops inside an
accepted block, scores, and the Hub-style folder.

Every test runs on the virtual clock (``tests/clock.py``) with flat costs (any forward 1 s), so the tree policy
always finds verifying more guesses free: the tries are as large as the policy allows on every CPU, and each
test asserts that they were used (accepted guesses), so that it exercises the trie rows and not plain steps.
"""

from pathlib import Path

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_specdec
from hf_specdec import loop
from tests.clock import VirtualClock
from tests.conftest import char_tokenizer, perturbed_copy, tiny_model

REPO_ROOT = Path(__file__).resolve().parent.parent
NEW = 40
REPETITIVE = torch.tensor([[3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]])


@pytest.fixture
def model(monkeypatch):
    model = tiny_model("llama", seed=0)
    VirtualClock(monkeypatch).charge(monkeypatch, model, lambda n: 1.0)
    return model


def plain(model, prompt=REPETITIVE, **kwargs):
    return type(model).generate(model, prompt, max_new_tokens=NEW, do_sample=False, **kwargs)


def lookahead(model, memory, prompt=REPETITIVE, **kwargs):
    return model.generate(prompt, custom_generate=hf_specdec.lookahead_generate, lookahead_memory=memory,
                          max_new_tokens=NEW, do_sample=False, **kwargs)


def warm_memory(model, prompt=REPETITIVE, **kwargs):
    """A memory that has seen this request once (its text, the recycling table, t(1) measured)."""
    memory = hf_specdec.LookaheadMemory()
    lookahead(model, memory, prompt, **kwargs)
    return memory


def cut_tokens(stats):
    """Tokens the target accepted but the loop did not emit (cut at a stop): rounds after the prefill would
    emit accepted + 1 each; the prefill emits 1."""
    return stats.accepted + (stats.rounds - 1) + 1 - stats.new_tokens


# -- out of memory in a lookahead round ---------------------------------------------------------------------------
class WideInputsRunOutOfMemory:
    """From the ``after``-th call on, a forward over more than one token raises out of memory (one-token plain
    steps still work). Wrapped around the whole model, or around its second decoder layer: then the first layer
    has already written this round's KV into the cache when the error comes, and the loop must roll it back."""

    def __init__(self, forward, after):
        self.forward, self.calls, self.after, self.raised = forward, 0, after, 0

    def __call__(self, *args, **kwargs):
        hidden = kwargs.get("input_ids", kwargs.get("hidden_states", args[0] if args else None))
        self.calls += 1
        if self.calls > self.after and hidden.shape[1] > 1:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.forward(*args, **kwargs)


@pytest.mark.parametrize("where", ["model", "second_layer"])
def test_out_of_memory_in_a_lookahead_round_finishes_with_plain_decoding(model, where, monkeypatch, caplog):
    """Output and scores equal plain greedy's. The scores see a cache left dirty by the failed round (the first
    layer's KV of ~60 inputs): without the loop's rollback the next step reads them (scores off by ~0.07)."""
    expected = plain(model, output_scores=True, return_dict_in_generate=True)
    memory = warm_memory(model)  # the next call verifies tries from its first round on
    module = model if where == "model" else model.model.layers[1]
    failing = WideInputsRunOutOfMemory(module.forward, after=2)  # the prefill and the first round pass
    monkeypatch.setattr(module, "forward", failing)
    out = lookahead(model, memory, output_scores=True, return_dict_in_generate=True)
    stats = out.spec_stats
    assert torch.equal(out.sequences, expected.sequences)
    assert torch.allclose(torch.cat(out.scores), torch.cat(expected.scores), atol=1e-4)
    # the round hit it, then again with half its guesses (any forward over more than one token fails here);
    # every round after that was a plain one-token step
    assert failing.raised == 2 and stats.guess_cap is not None
    assert stats.fell_back is not None and stats.fell_back.startswith("out of memory")
    assert "plain decoding" in caplog.text
    assert stats.accepted > 0  # the round before it verified a trie
    assert stats.new_tokens == NEW and stats.rounds_spec_off == stats.rounds - 2  # plain after the failure


def test_other_errors_in_a_lookahead_round_are_not_swallowed(model, monkeypatch):
    memory = warm_memory(model)
    forward = model.forward

    def broken(*args, **kwargs):
        if kwargs["input_ids"].shape[1] > 1 and kwargs.get("attention_mask") is not None:
            raise ValueError("a real bug")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", broken)
    with pytest.raises(ValueError, match="a real bug"):
        lookahead(model, memory)


# -- logits processors on trie rows -------------------------------------------------------------------------------
PROCESSORS = {
    "repetition_penalty": dict(repetition_penalty=1.3),
    "no_repeat_ngram": dict(no_repeat_ngram_size=3),
    "both": dict(repetition_penalty=1.3, no_repeat_ngram_size=3),
}


def record_processed_proposals(monkeypatch):
    seen, process = [], loop._process

    def spy(inputs, requests):  # per request: (row, its committed ids, its proposal, its logits)
        seen.extend(proposal for _, _, proposal, _ in requests)
        return process(inputs, requests)

    monkeypatch.setattr(loop, "_process", spy)
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("name", list(PROCESSORS))
def test_processors_on_trie_rows_equal_plain_greedy(arch, name, monkeypatch):
    """Each trie node is processed with its own path as the prefix: the output is plain greedy's with the same
    processors, on a cold call and on a call whose memory proposes the whole answer in deep branching tries."""
    model = tiny_model(arch, seed=0)
    VirtualClock(monkeypatch).charge(monkeypatch, model, lambda n: 1.0)
    kwargs = PROCESSORS[name]
    expected = plain(model, **kwargs)
    assert not torch.equal(expected, plain(model))  # the processors change what greedy says
    memory = hf_specdec.LookaheadMemory()
    assert torch.equal(lookahead(model, memory, **kwargs), expected)
    assert model.last_spec_stats.accepted > 0
    seen = record_processed_proposals(monkeypatch)
    assert torch.equal(lookahead(model, memory, **kwargs), expected)
    assert model.last_spec_stats.accepted > NEW / 2
    assert any(len(set(p.parents)) < len(p.parents) and p.depth >= 3 for p in seen)  # branching, deep tries


def committed_prefix_only(inputs, requests):
    """Every node processed after the committed tokens alone."""
    return [torch.cat([inputs.logits_processor(ids, logits[i: i + 1]) for i in range(logits.shape[0])])
            for _, ids, _, logits in requests]


def node_id_prefix(inputs, requests):
    """Node i processed after nodes 0..i in id order: its siblings' branches leak into its prefix."""
    out = []
    for _, ids, proposal, logits in requests:
        rows = [inputs.logits_processor(ids, logits[0:1])]
        for node in range(proposal.num_tokens):
            prefix = torch.cat([ids, torch.tensor([proposal.tokens[: node + 1]])], dim=1)
            rows.append(inputs.logits_processor(prefix, logits[1 + node: 2 + node]))
        out.append(torch.cat(rows))
    return out


@pytest.mark.parametrize("wrong", [committed_prefix_only, node_id_prefix])
def test_the_parity_check_catches_processors_at_the_wrong_prefix(model, wrong, monkeypatch):
    """The test above can fail: with the trie rows processed at a wrong prefix, the output is not greedy's."""
    kwargs = PROCESSORS["no_repeat_ngram"]
    expected = plain(model, **kwargs)
    monkeypatch.setattr(loop, "_process", wrong)
    memory = hf_specdec.LookaheadMemory()
    outputs = [lookahead(model, memory, **kwargs) for _ in range(2)]
    assert not any(torch.equal(out, expected) for out in outputs)


# -- stops inside an accepted block -------------------------------------------------------------------------------
class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def stop_positions(model, kind):
    """New-token indices j where a stop of this kind, built from the free output, first fires at j, and that
    the lookahead run with a warm memory emitted inside a block with more tokens after j."""
    free = plain(model)[0, REPETITIVE.shape[1]:].tolist()
    lookahead(model, warm_memory(model))
    blocks, start = [], 1  # new token 0 comes from the prefill
    for _, emitted in model.last_spec_stats.round_log[1:]:
        blocks.append((start, start + emitted))
        start += emitted
    full = REPETITIVE[0].tolist() + free
    offset = REPETITIVE.shape[1]
    for j in range(1, NEW):
        if not any(begin <= j < end - 1 for begin, end in blocks):
            continue
        if kind == "token" and free[j] not in free[:j]:
            yield j
        if kind == "string" and all(full[offset + i - 1: offset + i + 1] != full[offset + j - 1: offset + j + 1]
                                    for i in range(j)):
            yield j


@pytest.mark.parametrize("kind", ["string", "token"])
def test_stop_inside_an_accepted_block_equals_plain_generate(model, kind):
    tokenizer = char_tokenizer()
    hf_specdec.enable(model)
    j = next(stop_positions(model, kind))
    free = plain(model)[0, REPETITIVE.shape[1]:]
    if kind == "string":
        stop = dict(stop_strings=[tokenizer.decode(free[j - 1: j + 1])], tokenizer=tokenizer)
    else:
        stop = dict(stopping_criteria=StoppingCriteriaList([StopAfterToken(int(free[j]))]))
    expected = model.generate.__wrapped__(REPETITIVE, max_new_tokens=NEW, do_sample=False, output_scores=True,
                                          return_dict_in_generate=True, **stop)
    assert expected.sequences.shape[1] == REPETITIVE.shape[1] + j + 1  # the stop fires at j in plain generate
    out = model.generate(REPETITIVE, decoding="lookahead", lookahead_memory=warm_memory(model),
                         max_new_tokens=NEW, do_sample=False, output_scores=True, return_dict_in_generate=True,
                         **stop)
    assert torch.equal(out.sequences, expected.sequences)
    assert cut_tokens(out.spec_stats) > 0  # accepted tokens after the stop were dropped
    assert len(out.scores) == j + 1  # one score per returned token, none for the dropped ones
    assert torch.allclose(torch.cat(out.scores), torch.cat(expected.scores), atol=1e-4)


# -- scores -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{}, dict(repetition_penalty=1.3)], ids=["raw", "repetition_penalty"])
@pytest.mark.parametrize("mode", ["lookahead", "speculative"])
def test_output_scores_equal_plain_generate(model, mode, kwargs):
    """Through enable(model): one processed score row per emitted token, equal to plain generate's, with
    guesses accepted (rows from the trie / the chain, not only plain steps)."""
    draft = perturbed_copy(tiny_model("llama", seed=0), 0.003)  # about 40% of its tokens accepted
    hf_specdec.enable(model)
    expected = model.generate.__wrapped__(REPETITIVE, max_new_tokens=NEW, do_sample=False, output_scores=True,
                                          return_dict_in_generate=True, **kwargs)
    if mode == "lookahead":
        model.generate(REPETITIVE, decoding="lookahead", max_new_tokens=NEW, do_sample=False, **kwargs)  # warm
        routed = dict(decoding="lookahead")
    else:
        routed = dict(assistant_model=draft, spec_config=hf_specdec.SpecConfig(policy="fixed"))
    out = model.generate(REPETITIVE, max_new_tokens=NEW, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, **routed, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert out.spec_stats.mode == mode and 0 < out.spec_stats.accepted < out.spec_stats.drafted
    assert len(out.scores) == len(expected.scores) == NEW
    assert all(score.shape == (1, model.config.vocab_size) for score in out.scores)
    assert torch.allclose(torch.cat(out.scores), torch.cat(expected.scores), atol=1e-4)


# -- the Hub-style folder -----------------------------------------------------------------------------------------
def test_hub_style_folder_routes_decoding_lookahead(model):
    expected = plain(model)
    out = model.generate(REPETITIVE, custom_generate=str(REPO_ROOT), trust_remote_code=True, decoding="lookahead",
                         max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    stats = model.last_spec_stats.get()
    assert stats.mode == "lookahead" and stats.new_tokens == NEW
    assert stats.accepted > 0 and stats.rounds < NEW  # it really ran lookahead rounds
