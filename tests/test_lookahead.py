"""Lookahead decoding end to end: greedy parity, KV compaction, stops, streaming, refusal of flash attention."""


import dataclasses

import pytest
import torch

import hf_specdec
from hf_specdec import cache as kv
from hf_specdec.config import LookaheadConfig
from hf_specdec.costmodel import DecayedAcceptance, Estimates, ForwardCost, best_count
from hf_specdec.drafters.lookahead import LookaheadDrafter
from hf_specdec.layout import merge_candidates, round_layout, stack_layouts, window_inputs
from hf_specdec.memory import LookaheadMemory
from hf_specdec.policy import Planner, free_extra_tokens, rank_prefixes, window_shape
from hf_specdec.round import Candidate, Offer, Proposal, RoundOutcome, RowView, SourceKind
from hf_specdec.verify import verify_tree_sampled
from tests.clock import VirtualClock
from tests.conftest import tiny_model

NEW = 40
REPETITIVE = torch.tensor([[3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]])
RANDOM = torch.tensor([[5, 17, 42, 8, 23, 61, 2, 9, 77, 31]])
CONFIGS = {
    "auto": LookaheadConfig(),
    "w3n3g2": LookaheadConfig(window=3, ngram=3, max_candidates=2),
    "w4n4g3_no_prompt_pool": LookaheadConfig(window=4, ngram=4, max_candidates=3, pool_from_prompt=False),
}


def plain(model, prompt, **kwargs):
    return type(model).generate(model, prompt, max_new_tokens=NEW, do_sample=False, **kwargs)


def lookahead(model, prompt, config, **kwargs):
    return model.generate(prompt, custom_generate=hf_specdec.lookahead_generate, lookahead_config=config,
                          max_new_tokens=NEW, do_sample=False, **kwargs)


@pytest.mark.parametrize("arch,attention", [("llama", "sdpa"), ("qwen2", "sdpa"), ("gpt2", "sdpa"), ("qwen2", "eager"),
                                            ("gpt2", "eager")])
@pytest.mark.parametrize("prompt", [REPETITIVE, RANDOM], ids=["repetitive", "random"])
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_greedy_lookahead_equals_plain_greedy(arch, attention, prompt, config, monkeypatch):
    """Costs injected, so every case guesses on any machine: forwards are flat on a virtual clock (t(n) = 1 s for
    any n; a measured t(64) / t(1) of 2.7, the CPU's, prices a window that has found nothing yet out) and the
    memory is seeded flat."""
    model = tiny_model(arch, attn_implementation=attention)
    VirtualClock(monkeypatch).charge(monkeypatch, model, lambda n: 1.0)
    memory = LookaheadMemory()
    memory.seed({n: 1.0 for n in range(1, 65)})
    out = lookahead(model, prompt, config, lookahead_memory=memory)
    assert torch.equal(out, plain(model, prompt))
    stats = model.last_spec_stats.get()
    assert stats.mode == "lookahead" and stats.new_tokens == NEW
    assert stats.drafted > 0 and stats.rounds < NEW, stats.round_log


def test_repetitive_text_needs_fewer_forwards():
    model = tiny_model("qwen2")
    lookahead(model, REPETITIVE, CONFIGS["w3n3g2"])
    stats = model.last_spec_stats.get()
    assert stats.accepted > 0 and stats.mean_accepted_length > 1.2, stats.round_log


def test_enable_routes_decoding_lookahead():
    model = hf_specdec.enable(tiny_model("llama"))
    out = model.generate(RANDOM, decoding="lookahead", max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, plain(model, RANDOM))
    out = model.generate(REPETITIVE, decoding="lookahead", lookahead_config={"window": 2, "ngram": 2},
                         max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain(model, REPETITIVE)) and out.spec_stats.mode == "lookahead"


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_stops_exactly_at_max_new_tokens(max_new_tokens):
    model = tiny_model("llama")
    out = model.generate(REPETITIVE, custom_generate=hf_specdec.lookahead_generate, max_new_tokens=max_new_tokens,
                         lookahead_config=CONFIGS["w3n3g2"], do_sample=False)
    ref = type(model).generate(model, REPETITIVE, max_new_tokens=max_new_tokens, do_sample=False)
    assert torch.equal(out, ref)


def test_stops_exactly_at_eos_inside_an_accepted_block():
    model = tiny_model("qwen2")
    reference = plain(model, REPETITIVE)
    eos = int(reference[0, REPETITIVE.shape[1] + 5])  # a token greedy emits 6th
    out = lookahead(model, REPETITIVE, CONFIGS["w3n3g2"], eos_token_id=eos, pad_token_id=eos)
    assert torch.equal(out, plain(model, REPETITIVE, eos_token_id=eos, pad_token_id=eos))
    assert int(out[0, -1]) == eos


def test_streams_exactly_what_is_returned():
    class Recorder:
        def __init__(self):
            self.chunks, self.rounds, self.ended = [], [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def on_round(self, accepted, emitted):
            self.rounds.append((accepted, emitted))

        def end(self):
            self.ended = True

    model = tiny_model("llama")
    streamer = Recorder()
    out = lookahead(model, REPETITIVE, CONFIGS["w3n3g2"], spec_streamer=streamer)
    assert streamer.ended and streamer.chunks[0] == REPETITIVE[0].tolist()
    assert sum(streamer.chunks[1:], []) == out[0, REPETITIVE.shape[1]:].tolist()
    assert [emitted for _, emitted in streamer.rounds] == [len(c) for c in streamer.chunks[1:]]


def test_sampling_runs_and_is_reproducible_with_a_seed():
    model = tiny_model("llama")
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(model.generate(REPETITIVE, custom_generate=hf_specdec.lookahead_generate, do_sample=True,
                                   temperature=0.8, top_k=20, max_new_tokens=NEW,
                                   lookahead_config=CONFIGS["w3n3g2"]))
    assert outs[0].shape == (1, REPETITIVE.shape[1] + NEW) and torch.equal(outs[0], outs[1])


def test_a_kept_path_equals_a_fresh_forward_over_the_accepted_tokens():
    model = tiny_model("llama")
    prompt = REPETITIVE[:, :-1]
    cache = kv.KVStore(model, "sdpa")
    cache.prefill(prompt, None)
    last = int(REPETITIVE[0, -1])
    extra = window_inputs(torch.tensor([[last, 9, 10], [11, 12, 13]]))  # W=3, N=3 window (its KV must be dropped)
    trie = merge_candidates([Candidate(c, (SourceKind.POOL, 0)) for c in [(5, 6, 7), (5, 8), (4, 2)]], 8, extra=extra)
    step = round_layout(trie, last)
    written = cache.forward(stack_layouts([step]))
    cache.keep([written.slots[0, step.kept_inputs([0, 3])].tolist()])  # the path 5 -> 8: one row gathers it
    assert cache.dense and cache.gathers == 1 and cache.compact() == 0  # no hole left to compact

    fresh = kv.new_cache(model)
    kv.call_model(model, torch.cat([REPETITIVE, torch.tensor([[5, 8]])], dim=1), fresh)
    assert cache.cache.get_seq_length() == fresh.get_seq_length() == REPETITIVE.shape[1] + 2
    assert cache.dense and cache.lengths.tolist() == [REPETITIVE.shape[1] + 2]
    for layer, fresh_layer in zip(cache.cache.layers, fresh.layers):
        torch.testing.assert_close(layer.keys, fresh_layer.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values, fresh_layer.values, atol=1e-5, rtol=1e-5)


def test_flash_attention_reads_no_trie_and_runs_chains():
    """flash attention takes no 4-D mask: lookahead is not refused, it verifies chains (tests/test_lookahead_chains)."""
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"  # what a model loaded with flash attention reports
    hf_specdec.support.check_supported(model, "lookahead")  # not refused
    assert hf_specdec.support.tree_refusal(model) == (
        "attn_implementation='flash_attention_2' cannot take a custom 4-D attention mask (load the model with "
        "attn_implementation='sdpa' or 'eager')")


def test_round_size_follows_expected_rate_and_measured_cost():
    # a long prompt-lookup continuation that is usually accepted, and a short unlikely pool candidate
    ranked = rank_prefixes([((1, 2, 3, 4, 5, 6), [0.9] * 6), ((7, 8), [0.2, 0.5])])
    assert [prefix for prefix, _ in ranked[:3]] == [(1,), (1, 2), (1, 2, 3)]
    assert all(len(prefix) == 1 or prefix[:-1] in [p for p, _ in ranked[:i]] for i, (prefix, _) in enumerate(ranked))
    gains = [gain for _, gain in ranked]
    flat = lambda n: 1.0  # noqa: E731  (bf16 CPU / GPU: extra tokens almost free)
    knee = lambda n: 1.0 if n <= 3 else 1.0 + 0.1 * (n - 3)  # noqa: E731  (flat to 4 inputs, then rising)
    steep = lambda n: float(n + 1)  # noqa: E731  (fp32 CPU, large model: every token costs a full step)
    assert best_count(gains, flat, 63) == len(gains)
    assert best_count(gains, flat, 3) == 3
    assert 3 <= best_count(gains, knee, 63) < len(gains)
    assert best_count(gains, steep, 63) == 0  # speculating does not pay: a plain step
    # the window only takes tokens that keep the forward within the tolerance of its cost
    assert free_extra_tokens(lambda n: 1.0 if n <= 4 else 1.0 + 0.1 * (n - 4), used=2, limit=30,
                             tolerance=0.15) == 3
    assert free_extra_tokens(lambda n: float(n), used=1, limit=30, tolerance=0.15) == 0
    assert window_shape(4) == (1, 2) and window_shape(31) == (10, 4)


def test_window_gets_tokens_only_while_its_pool_pays():
    config, estimates = LookaheadConfig(), Estimates()
    estimates.regret.plain_seconds = 1000.0  # earlier calls' plain time: the regret budget is not what is tested
    policy = Planner.lookahead(config, estimates)
    view = RowView(0, torch.arange(10), 8)

    def plan():
        return policy.plan([view], [Offer()])[0]

    for size, seconds in [(1, 1.0), (8, 1.05), (16, 1.1), (32, 1.2)]:  # extra tokens cost a little
        estimates.forward.observe(size, seconds)
    assert plan().window[0] > 1  # optimistic prior: the window is tried
    estimates.ema("round_tokens").update(1.2)
    estimates.ema("pool_gain").update(0.0)  # its n-grams never added a token beyond prompt lookup
    assert plan().window == (1, 2)
    estimates.ema("pool_gain").update(0.6)  # now they do: worth up to 15% more per forward
    assert plan().window[0] > 1
    # every `remeasure_interval` rounds without a trie, one plain step keeps t(1), the reference, fresh
    plans = []
    for _ in range(config.remeasure_interval):  # rounds count as they are observed: planning is a query
        plans.append(plan())
        policy.observe([RoundOutcome(Proposal(), (), 0, (0,), 10, 1, 1.0, plan=plans[-1])])
    assert sum(plan.is_plain for plan in plans) == 1


def test_a_batch_lookahead_round_grows_from_its_plain_step_one_doubling_at_a_time():
    """At B = 8 after a plain step (8 inputs measured) every larger forward looks free by flat extrapolation; a
    round reads at most twice what was measured (2 per row), not 8 per row (a 64-input forward)."""
    config, estimates = LookaheadConfig(), Estimates()
    policy = Planner.lookahead(config, estimates)
    views = [RowView(r, torch.arange(10), 32) for r in range(8)]
    offers = [Offer(candidates=(Candidate(tuple(range(20, 30)), (SourceKind.HISTORY, 2)),))] * 8
    estimates.forward.observe(8, 1.0)  # the plain step of 8 rows

    def inputs(plan):  # per row: the last committed token and the trie (no window this small)
        assert plan.window == (1, 2)
        return 1 + sum(len(c.tokens) for c in plan.candidates)

    assert {inputs(plan) for plan in policy.plan(views, offers)} == {2}
    estimates.forward.observe(16, 1.0)
    assert {inputs(plan) for plan in policy.plan(views, offers)} == {4}


def test_a_batch_lookahead_round_widens_only_when_the_whole_batch_gains():
    """The forward is padded to its widest row: one row's guess costs every row its slot. At B = 4 with
    t(4) = 0.10 and t(8) = 0.13, one row with a 0.6 guess (history match of 3) gains 1.6 tokens for 1.3x the
    time on its own, but the batch emits 4.6 tokens for 1.3x (plain); when every row has one it emits 6.4."""
    config, estimates = LookaheadConfig(), Estimates()
    estimates.regret.plain_seconds = 1000.0  # the regret budget is not what is tested here
    policy = Planner.lookahead(config, estimates)
    views = [RowView(r, torch.arange(10), 32) for r in range(4)]
    estimates.forward.observe(4, 0.10)
    estimates.forward.observe(8, 0.13)
    estimates.forward.observe(16, 0.40)  # past two per row, a steep rise (no window fits)
    guess, nothing = Offer(candidates=(Candidate((20,), (SourceKind.HISTORY, 3)),)), Offer()
    assert all(plan.is_plain for plan in policy.plan(views, [guess, nothing, nothing, nothing]))
    plans = policy.plan(views, [guess] * 4)
    assert [plan.candidates for plan in plans] == [guess.candidates] * 4


def test_depth_acceptance_learns_per_depth():
    rates = DecayedAcceptance(prior=0.3, decay=0.98, slots=4)
    for _ in range(50):
        rates.observe(judged=3, accepted=2)  # the first two tokens accepted, the third rejected
    assert rates.rate(1) > 0.9 and rates.rate(2) > 0.9 and rates.rate(3) < 0.1
    assert rates.rate(4) == pytest.approx(0.3) and rates.rate(99) == rates.rate(4)  # never judged: the prior
    assert DecayedAcceptance(prior=0.3, slots=4).rates(6) == [0.3] * 6  # nothing seen: the prior at every depth


def _lookahead_planner(estimates: Estimates) -> Planner:
    estimates.regret.plain_seconds = 1000.0  # the regret budget is not what is tested
    return Planner.lookahead(LookaheadConfig(window=1), estimates)


def _trie_depth(planner: Planner, key, length: int) -> int:
    offer = Offer(candidates=(Candidate(tuple(range(100, 100 + length)), key),))
    plan = planner.plan([RowView(0, torch.arange(10), 32)], [offer])[0]
    return max((len(c.tokens) for c in plan.candidates), default=0)


def test_a_depth_never_judged_is_priced_as_the_depth_before_it():
    """Copies kept in full at depths 1..5 make a 12-token copy's depths 6..12 as likely: the round verifies it.
    Priced at the source's prior (0.45), depth 6 was never worth its inputs, so rounds stayed at depth 5 and
    depth 6 was never judged: the estimate could not correct itself."""
    estimates = Estimates()
    planner = _lookahead_planner(estimates)
    for n, seconds in [(1, 0.49), (6, 0.62), (8, 0.72), (12, 0.95), (16, 1.2)]:
        estimates.forward.observe(n, seconds)
    key = (SourceKind.HISTORY, 2)
    for _ in range(20):
        planner.learned(key).observe(judged=5, accepted=5)
    assert planner.acceptance(key).rate(6) > 0.95
    assert _trie_depth(planner, key, 12) == 12


def test_sizes_still_seeded_are_priced_at_the_level_measured_here():
    """A proxy profile 30% above this model's t(1) and t(2) (and noisy at 3-4 inputs) priced a 6-input round at
    its seed, 0.66 s against 0.50 at the measured level; scaled, the round verifies the whole 8-token copy."""
    profile = {1: 0.57, 2: 0.54, 3: 0.78, 4: 0.75, 6: 0.66, 8: 0.79, 12: 1.04, 16: 1.25}
    estimates = Estimates(forward=ForwardCost.from_table(profile, prior=True))
    planner = Planner.lookahead(LookaheadConfig(window=1), estimates)  # no credit: seeds priced as they stand
    estimates.forward.observe(1, 0.41)
    estimates.forward.observe(2, 0.43)
    assert planner.price()(6) == pytest.approx(0.66 * (0.41 / 0.57 + 0.43 / 0.54) / 2)
    key = (SourceKind.HISTORY, 2)
    for _ in range(20):
        planner.learned(key).observe(judged=3, accepted=2)  # the third token is where copies miss
        planner.learned(key).observe(judged=8, accepted=8)
    assert _trie_depth(planner, key, 8) == 8


def test_alternative_continuations_are_learned_apart_from_the_first():
    model = tiny_model("llama")
    drafter = LookaheadDrafter(model, LookaheadConfig())
    policy = Planner.lookahead(LookaheadConfig(), Estimates())
    view = RowView(0, torch.tensor([9, 1, 2, 9, 1, 3, 9, 1, 4, 9, 1]), 1)  # "9 1" was followed by 4, 3 and 2
    drafter.prefill(view)
    offer = drafter.offer(view)
    assert offer.candidates == (Candidate((4,), (SourceKind.HISTORY, 2)), Candidate((3,), (SourceKind.HISTORY_ALT, 2)),
                                Candidate((2,), (SourceKind.HISTORY_ALT, 2)))
    proposal = merge_candidates(offer.candidates, 8)
    for _ in range(20):  # the target always takes the first continuation
        policy.observe([RoundOutcome(proposal, accepted=(0,), next_token=7, emitted=(4, 7), start_length=11,
                                     forward_tokens=4, verify_time=0.1)])
    first, alternative = policy.acceptance((SourceKind.HISTORY, 2)), policy.acceptance((SourceKind.HISTORY_ALT, 2))
    assert first.rate(1) > 0.85 and alternative.rate(1) < 0.1
    # so a trie of alternatives is not credited with more tokens than one can give
    ranked = rank_prefixes([(c.tokens, [policy.acceptance(c.source).rate(1)]) for c in offer.candidates])
    assert sum(gain for _, gain in ranked) < 1.0


def test_config_validation():
    with pytest.raises(ValueError, match="window"):
        LookaheadConfig(window=0)
    with pytest.raises(ValueError, match="unknown"):
        LookaheadConfig.from_dict({"windows": 3})


def test_verify_tree_with_sampled_targets_is_lossless_for_the_first_token():
    # one candidate per root child; the emitted first token is the target's own sample whatever the trie holds
    trie = merge_candidates([Candidate((1, 2), (SourceKind.POOL, 0)), Candidate((3,), (SourceKind.POOL, 0))], 4)
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.0, 0.2])
    counts = torch.zeros(4)
    for _ in range(4000):
        verdict = verify_tree_sampled(trie.tokens, trie.parents, None, probs.expand(1 + trie.num_tokens, 4),
                                      torch.rand(trie.num_tokens, generator=generator))
        counts[trie.tokens[verdict.accepted[0]] if verdict.accepted else verdict.next_token] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


# -- LookaheadMemory: what one call learns, carried into the next ------------------------------------------------------
def test_memory_makes_a_repeated_request_cheap_and_keeps_output_exact():
    model = tiny_model("qwen2")
    memory = LookaheadMemory()
    expected = plain(model, RANDOM)
    first = lookahead(model, RANDOM, LookaheadConfig(), lookahead_memory=memory)
    first_stats = model.last_spec_stats.get()
    assert first_stats.draft_length_hist[0] >= 1  # cold: the first round is a plain step that measures t(1)
    assert memory.corpus.tokens[: RANDOM.shape[1]] == RANDOM[0].tolist() and memory.estimates.forward.measured(1)
    # the tiny model's timings are noise (on an AVX2-only EPYC its first forwards over 8 inputs took 10 plain steps:
    # the kernels' cold start for a new shape), and they decide whether the first call's guesses paid: the costs
    # are set here, and the regret budget (tested on its own above, with set costs) is opened
    memory.estimates.forward = ForwardCost.from_table({1: 0.01, 8: 0.01, 16: 0.011, 64: 0.02})
    second = lookahead(model, RANDOM, LookaheadConfig(max_regret=0.5), lookahead_memory=memory)
    second_stats = model.last_spec_stats.get()
    assert torch.equal(first, expected) and torch.equal(second, expected)
    # the earlier answer is a candidate from the first round on: a few forwards instead of one per token
    assert second_stats.round_log[1][0] > 0, second_stats.round_log
    assert second_stats.rounds < first_stats.rounds / 2, (first_stats.rounds, second_stats.rounds)


def test_a_memory_seeded_with_a_steep_forward_cost_never_guesses():
    """The hardware profile's t(n) seeds a cold memory (``LookaheadMemory.seed``): where a forward of n inputs
    costs n plain steps (worse than a CPU without bf16 units), no round is worth a guess and none is tried;
    the same call unseeded explores sizes it has not measured and guesses."""
    model = tiny_model("qwen2")
    expected = plain(model, REPETITIVE)
    steep = LookaheadMemory()
    steep.seed({n: 0.5 * n for n in (1, 2, 4, 8, 16, 32, 64)})
    assert steep.estimates.forward.estimate(8) == 4.0
    assert torch.equal(lookahead(model, REPETITIVE, LookaheadConfig(), lookahead_memory=steep), expected)
    assert model.last_spec_stats.drafted == 0 and model.last_spec_stats.rounds == NEW  # prefill + 39 plain steps
    assert set(model.last_spec_stats.verify_time_by_tokens) == {1}  # not even a Jacobi window was tried
    assert torch.equal(lookahead(model, REPETITIVE, LookaheadConfig(), lookahead_memory=LookaheadMemory()), expected)
    assert max(model.last_spec_stats.verify_time_by_tokens) > 1  # guesses or a window: a forward over more inputs
    measured = LookaheadMemory()
    measured.estimates.forward.observe(1, 0.01)
    measured.seed({1: 0.5})  # a memory that measured something keeps it
    assert measured.estimates.forward.estimate(1) == 0.01


def test_memory_from_another_request_keeps_output_exact():
    model = tiny_model("llama")
    memory = LookaheadMemory()
    lookahead(model, REPETITIVE, LookaheadConfig(), lookahead_memory=memory)
    other = torch.tensor([[9, 5, 17, 42, 8, 3, 4, 5]])  # shares n-grams with the first request, not its answer
    assert torch.equal(lookahead(model, other, LookaheadConfig(), lookahead_memory=memory), plain(model, other))


def test_enable_keeps_one_memory_per_model_and_none_opts_out():
    model = hf_specdec.enable(tiny_model("llama"))
    assert isinstance(model.lookahead_memory, LookaheadMemory)
    model.generate(RANDOM, decoding="lookahead", max_new_tokens=8, do_sample=False, lookahead_memory=None)
    assert model.lookahead_memory.corpus.tokens == []  # that call neither read nor wrote it
    model.generate(RANDOM, decoding="lookahead", max_new_tokens=8, do_sample=False)
    assert model.lookahead_memory.corpus.tokens[: RANDOM.shape[1]] == RANDOM[0].tolist()
    other = hf_specdec.enable(tiny_model("llama"))
    assert other.lookahead_memory is not model.lookahead_memory
    hf_specdec.disable(model)
    assert not hasattr(model, "lookahead_memory")


def test_memory_is_bounded_and_validated():
    memory = LookaheadMemory(max_tokens=10)
    memory.remember(range(8))
    memory.remember(range(100, 104))  # 12 tokens > 10: keep the newest 5
    assert memory.corpus.tokens == [7, 100, 101, 102, 103]
    assert memory.corpus.matches(max_len=2, limit=4, suffix=[100], suffix_only=True) == [((101, 102), 1)]
    memory.clear()
    assert memory.corpus.tokens == [] and not memory.estimates.forward.measured(1)
    with pytest.raises(ValueError, match="max_tokens"):
        LookaheadMemory(max_tokens=0)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="LookaheadMemory"):
        lookahead(model, RANDOM, LookaheadConfig(), lookahead_memory={"corpus": []})


# -- Token Recycling: the target's own top choices, kept per token ---------------------------------------------------
def test_memory_keeps_the_newest_top_choices_after_each_token():
    memory = LookaheadMemory()
    memory.recycle(torch.tensor([5, 9]), torch.tensor([[6, 7], [1, 2]]))
    memory.recycle(torch.tensor([5]), torch.tensor([[8, 6]]))  # 5 read again, in another context: newest wins
    assert memory.successors[5].tolist() == [8, 6]
    assert memory.successors[9].tolist() == [1, 2]
    assert memory.successors[3].tolist() == [-1, -1]  # never read: unknown
    memory.recycle(torch.tensor([5000]), torch.tensor([[4, 4]]))  # grows to new token ids, keeps the rest
    assert memory.successors[5000].tolist() == [4, 4] and memory.successors[5].tolist() == [8, 6]
    memory.clear()
    assert memory.successors is None


def test_recycled_candidates_chain_each_top_choice_by_the_top_choice_after_it():
    model = tiny_model("llama")
    drafter = LookaheadDrafter(model, LookaheadConfig(recycle_branches=3, recycle_second=1))
    drafter.memory.recycle(torch.tensor([5, 6, 7, 9]), torch.tensor([[6, 7, 9, 1], [9, 2, 3, 4], [8, 2, 3, 4],
                                                                      [5, 2, 3, 4]]))
    found = drafter._recycled(5, depth=4)
    # after 5 the target chose 6 (then 7, 9); 6 -> 9 -> 5 -> 6 ...; 7 -> 8 (8 never read: the chain stops);
    # and through the second choice after 6 (2, never read)
    assert found == [((6, 9, 5, 6), (SourceKind.RECYCLE, 0)), ((7, 8), (SourceKind.RECYCLE, 1)), ((9, 5, 6, 9), (SourceKind.RECYCLE, 2)),
                     ((6, 2), (SourceKind.RECYCLE_SECOND, 0))]
    assert drafter._recycled(5, depth=2)[0] == ((6, 9), (SourceKind.RECYCLE, 0))  # no deeper than asked
    assert drafter._recycled(3, depth=4) == []  # nothing known after 3


def test_a_call_fills_the_recycling_table_and_keeps_output_exact():
    model = tiny_model("qwen2")
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    memory = hf_specdec.LookaheadMemory()
    plain = model.generate(prompt, max_new_tokens=24, do_sample=False)
    for _ in range(2):  # the second call starts from the first one's table
        out = model.generate(prompt, max_new_tokens=24, do_sample=False,
                             custom_generate=hf_specdec.lookahead_generate, lookahead_memory=memory)
        assert torch.equal(out, plain)
    known = (memory.successors[:, 0] >= 0).nonzero()[:, 0].tolist()
    # every emitted token but the last was the first input of a later round, whose top choices were kept
    assert set(out[0, prompt.shape[1]:-1].tolist()) <= set(known)


def test_tokens_per_round_count_every_round_that_had_candidates_verified_or_not():
    """The window is worth what its pool adds per token emitted; tokens per round are averaged over the rounds
    that had candidates to guess from, including those whose plan verified none of them (as before the
    redesign): a 1-token round there lowers the average. Rows with nothing offered are not counted."""
    from hf_specdec.round import Proposal

    policy = Planner.lookahead(LookaheadConfig(), Estimates())
    views = [RowView(r, torch.arange(10), 32) for r in range(2)]
    offers = [Offer(candidates=(Candidate((5, 6), (SourceKind.HISTORY, 2)),)), Offer()]
    plans = policy.plan(views, offers)
    assert all(plan.is_plain for plan in plans)  # t(2) unmeasured: a plain step first
    plain = [RoundOutcome(Proposal(), (), 7, (7,), 10, 1, 0.1, row=r, rows=2, plan=plan) for r, plan in enumerate(plans)]
    policy.observe(plain)
    assert policy.estimates.ema("round_tokens").value == 1.0
    policy.estimates.ema("round_tokens").update(3.0)
    plans = policy.plan(views, [Offer(), Offer()])
    policy.observe([dataclasses.replace(outcome, plan=plan) for outcome, plan in zip(plain, plans)])  # nothing
    # was offered: the average is left as it was
    assert policy.estimates.ema("round_tokens").value == pytest.approx(0.7 * 1.0 + 0.3 * 3.0)


def test_the_regret_account_is_carried_to_the_next_call_at_half():
    """A round is sized by its worst case (every guess rejected: it loses t(n) - t(1)). Fresh, a call has no
    budget yet: its first round is a plain step, which earns 1.5% of 0.2 s (3 ms): enough for a 3-input round
    (2.9 ms at worst), not for all 4 inputs of the guess (4.3 ms); a miss (0.02 s) then spends it, and plain
    steps follow. After earlier calls where guessing paid (4 s of credit over 20 s of plain time, half of it
    carried), the first round guesses and the miss is covered; after earlier calls that lost their whole budget, the call starts at its budget: plain steps."""
    def call(earlier_lost, earlier_plain):
        estimates = Estimates()
        estimates.forward.observe(1, 0.2)
        estimates.forward.observe(8, 0.21)
        estimates.regret.lost, estimates.regret.plain_seconds = earlier_lost, earlier_plain
        policy = Planner.lookahead(LookaheadConfig(), estimates)  # a new call: start(max_regret=0.015)
        views = [RowView(0, torch.arange(10), 64)]
        offers = [Offer(candidates=(Candidate((5, 6, 7), (SourceKind.HISTORY, 3)),))]
        return policy, lambda: policy.plan(views, offers)[0]

    policy, plan = call(0.0, 0.0)  # a call on its own
    assert plan().is_plain
    policy.regret.observe(round_seconds=0.2, emitted=1, step=0.2, guessed=False)
    assert plan().candidates == (Candidate((5, 6), (SourceKind.HISTORY, 3)),)  # the guess cut to what is affordable
    policy.regret.observe(round_seconds=0.22, emitted=1, step=0.2, guessed=True)  # a miss
    assert plan().is_plain
    policy, plan = call(-4.0, 20.0)  # earlier calls paid
    assert not plan().is_plain
    policy.regret.observe(round_seconds=0.22, emitted=1, step=0.2, guessed=True)
    assert not plan().is_plain  # the miss is covered
    policy, plan = call(0.6, 20.0)  # earlier calls lost their budget: no new exploration
    assert plan().is_plain


def test_no_lookahead_round_can_lose_more_than_the_regret_budget_where_forwards_are_steep():
    """fp32 t(n) of the bundled 1.5B target with kernels limited to AVX2 (Intel Xeon, measured: a forward over
    8 inputs costs 2.1 plain steps). Every guess is rejected, the worst case: after every round the time lost
    against plain decoding stays within the budget (1.5% of plain decoding's time), and guessing is tried again as the budget
    allows (before, one 24-input round lost 0.5 s, more than the whole budget of a 64-token call)."""
    table = {1: 0.251, 2: 0.447, 4: 0.425, 8: 0.517, 16: 0.658, 32: 0.841}
    estimates = Estimates()
    for n, seconds in table.items():
        estimates.forward.observe(n, seconds)
    policy = Planner.lookahead(LookaheadConfig(), estimates)
    view = RowView(0, torch.arange(10), 200)
    offer = Offer(candidates=(Candidate(tuple(range(20, 36)), (SourceKind.HISTORY, 4)),
                              Candidate(tuple(range(40, 48)), (SourceKind.HISTORY_ALT, 4))))
    guessed = 0
    for _ in range(200):
        plan = policy.plan([view], [offer])[0]
        assert plan.window == (1, 2)  # no window on this curve
        proposal = merge_candidates(list(plan.candidates), max_nodes=64)
        inputs = 1 + proposal.num_tokens
        guessed += inputs > 1
        policy.observe([RoundOutcome(proposal, accepted=(), next_token=9, emitted=(9,), start_length=10,
                                     forward_tokens=inputs, verify_time=estimates.forward.estimate(inputs))])
        assert policy.regret.lost <= policy.settings.max_regret * policy.regret.plain_seconds + 1e-9
    assert guessed >= 3  # it kept probing, within the budget
def test_each_candidate_of_a_source_is_judged_and_fades_its_counts_once():
    """Two pool n-grams [5, 6] and [5, 7] share their first node; the target keeps 5, 6. Each candidate is
    judged (as before the redesign): the pool's first slot counts two kept tokens, its second one kept and one
    missed, and the counts fade once per candidate judged (twice a round here)."""
    from hf_specdec.layout import merge_candidates

    policy = Planner.lookahead(LookaheadConfig(), Estimates())
    proposal = merge_candidates([Candidate((5, 6), (SourceKind.POOL, 0)), Candidate((5, 7), (SourceKind.POOL, 0))], max_nodes=8)
    outcome = RoundOutcome(proposal, accepted=(0, 1), next_token=9, emitted=(5, 6, 9), start_length=10,
                           forward_tokens=4, verify_time=0.1)
    policy.observe([outcome])
    pool = policy.acceptance((SourceKind.POOL, 0))
    assert (pool.judged[:2], pool.kept[:2]) == ([2.0, 2.0], [2.0, 1.0])
    policy.observe([outcome])
    decay = LookaheadConfig().acceptance_decay
    assert pool.judged[0] == pytest.approx(2.0 * decay ** 2 + 2.0)
