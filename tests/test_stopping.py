"""Stops hold exactly inside accepted blocks, and the streamer sees exactly what is returned."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_specdec
from tests.conftest import char_tokenizer, perturbed_copy, tiny_model

NEW = 40


@pytest.fixture(scope="module")
def pair():
    model = tiny_model("llama", seed=0)
    hf_specdec.enable(model)
    return model, model  # draft = target: every draft accepted, so stops fall inside long accepted blocks


def reference(model, prompt, **kwargs):
    return model.generate.__wrapped__(prompt, do_sample=False, **kwargs)


def run(model, draft, prompt, **kwargs):
    return model.generate(prompt, assistant_model=draft, do_sample=False,
                          spec_config=hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=6), **kwargs)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 7, 13])
def test_max_new_tokens_exact(pair, prompt, max_new_tokens):
    model, draft = pair
    out = run(model, draft, prompt, max_new_tokens=max_new_tokens)
    assert out.shape[1] == prompt.shape[1] + max_new_tokens
    assert torch.equal(out, reference(model, prompt, max_new_tokens=max_new_tokens))


def test_eos_inside_accepted_block(pair, prompt):
    model, draft = pair
    free = reference(model, prompt, max_new_tokens=NEW)[0, prompt.shape[1]:]
    eos = int(free[9])  # a token the model emits in the middle of the generation
    expected = reference(model, prompt, max_new_tokens=NEW, eos_token_id=eos)
    out = run(model, draft, prompt, max_new_tokens=NEW, eos_token_id=eos)
    assert torch.equal(out, expected)
    assert int(out[0, -1]) == eos and out.shape[1] < prompt.shape[1] + NEW


def test_stop_strings_inside_accepted_block(pair, prompt):
    model, draft = pair
    tokenizer = char_tokenizer()
    free = reference(model, prompt, max_new_tokens=NEW)[0, prompt.shape[1]:]
    stop = tokenizer.decode(free[11:13])  # a two-token string
    expected = reference(model, prompt, max_new_tokens=NEW, stop_strings=[stop], tokenizer=tokenizer)
    out = run(model, draft, prompt, max_new_tokens=NEW, stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(out, expected)
    assert tokenizer.decode(out[0, prompt.shape[1]:]).endswith(stop)


class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria(pair, prompt):
    model, draft = pair
    free = reference(model, prompt, max_new_tokens=NEW)[0, prompt.shape[1]:]
    criteria = StoppingCriteriaList([StopAfterToken(int(free[6]))])
    expected = reference(model, prompt, max_new_tokens=NEW, stopping_criteria=criteria)
    out = run(model, draft, prompt, max_new_tokens=NEW, stopping_criteria=criteria)
    assert torch.equal(out, expected)


class Recorder(BaseStreamer):
    def __init__(self):
        self.chunks, self.rounds, self.ended = [], [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def on_round(self, num_accepted_draft, num_emitted):
        self.rounds.append((num_accepted_draft, num_emitted))

    def end(self):
        self.ended = True


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_streamer_sees_exactly_the_returned_tokens(prompt, policy):
    model = tiny_model("llama", seed=0)
    draft = perturbed_copy(model, 0.02)
    hf_specdec.enable(model)
    tokenizer = char_tokenizer()
    free = model.generate.__wrapped__(prompt, max_new_tokens=NEW, do_sample=False)[0, prompt.shape[1]:]
    stop = tokenizer.decode(free[20:22])
    streamer = Recorder()
    out = model.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=NEW, streamer=streamer,
                         stop_strings=[stop], tokenizer=tokenizer, spec_config=hf_specdec.SpecConfig(policy=policy))
    assert streamer.chunks[0] == prompt[0].tolist()
    streamed = [t for chunk in streamer.chunks[1:] for t in chunk]
    assert streamed == out[0, prompt.shape[1]:].tolist()
    assert streamer.ended
    assert [emitted for _, emitted in streamer.rounds] == [len(c) for c in streamer.chunks[1:]]
    assert sum(acc for acc, _ in streamer.rounds) <= model.last_spec_stats.accepted


def test_sampling_respects_max_new_tokens_and_eos(prompt):
    """Sampled speculative decoding stops at max_new_tokens, and at the first EOS: with the same seed (and a
    fixed k, so the random draws do not depend on timing) a run with an EOS token is the run without one cut
    just after that token's first occurrence, even when it was accepted inside a block of draft tokens."""
    model = tiny_model("llama", seed=0)
    draft = perturbed_copy(model, 0.02)
    hf_specdec.enable(model)
    fixed = hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=4)

    def sample(seed, **kwargs):
        torch.manual_seed(seed)
        out = model.generate(prompt, assistant_model=draft, do_sample=True, temperature=0.8, top_k=20,
                             max_new_tokens=17, spec_config=fixed, **kwargs)
        return out[0, prompt.shape[1]:].tolist()

    cut_inside_a_block = 0
    for seed in range(4):
        free = sample(seed)
        assert len(free) == 17
        # a token first seen inside a round's block of emitted tokens (not the block's first token) as the EOS
        starts, at = set(), 0
        for _, emitted in model.last_spec_stats.round_log:
            starts.add(at)
            at += emitted
        inside = [j for j in range(len(free)) if j not in starts and free[j] not in free[:j]]
        if not inside:
            continue
        eos = free[inside[0]]
        stopped = sample(seed, eos_token_id=eos, pad_token_id=eos)
        assert stopped == free[: inside[0] + 1], (seed, eos)
        assert model.last_spec_stats.round_log[-1][1] > 1  # the EOS came with tokens before it in its round
        cut_inside_a_block += 1
    assert cut_inside_a_block >= 2
