"""Draft-length policies, fed made-up measurements (no model, no clock: the costs are injected)."""

import dataclasses

import torch

from hf_specdec.costmodel import Estimates, ForwardCost
from hf_specdec.config import LookaheadConfig, SpecConfig
from hf_specdec.policy import DRAFT, LEADING_LOOKUP, LOOKUP, FixedPolicy, HeuristicPolicy, Planner, make_policy
from hf_specdec.round import Candidate, Offer, Proposal, RoundOutcome, RowView, Source, SourceKind

OFFER = Offer(model_tokens=64)


def plan(policy, budget, offer=OFFER):
    """One row's plan (the policies plan every row of a batch at once)."""
    return policy.plan([RowView(0, torch.arange(10), budget)], [offer])[0]


def observe(policy, outcome):
    policy.observe([outcome])


def chain(k, lookup=0, confidences=None, t_draft=0.0):
    sources = [Source(SourceKind.DRAFT, 0, i) for i in range(1, k + 1)] + [Source(SourceKind.LOOKUP, 0, j) for j in range(1, lookup + 1)]
    return Proposal.chain(range(10, 10 + k + lookup), sources, confidences=tuple(confidences or [0.9] * k),
                          draft_time=k * t_draft, draft_forwards=k)


def outcome(proposal, accepted, seconds, plan=None):
    return RoundOutcome(proposal, accepted=tuple(range(accepted)), next_token=0, emitted=(0,) * (accepted + 1),
                        start_length=10, forward_tokens=proposal.num_tokens + 1, verify_time=seconds,
                        **({} if plan is None else {"plan": plan}))


def feed(policy, rounds, k, accepted, t_draft, t_verify, plain_step=None, confidences=None):
    """Rounds that draft k tokens and accept `accepted` (cost: t_draft per draft forward, t_verify(n))."""
    if plain_step is not None:
        observe(policy, outcome(Proposal(), 0, plain_step))
    for _ in range(rounds):
        planned = plan(policy, 64, OFFER)
        observe(policy, outcome(chain(k, confidences=confidences, t_draft=t_draft), accepted, t_verify(k + 1),
                                planned))


def test_fixed():
    policy = FixedPolicy(5)
    assert plan(policy, 10, OFFER).model_tokens == 5 and plan(policy, 3, OFFER).model_tokens == 3


def test_heuristic_is_transformers_rule_without_the_empty_round_quirk():
    policy = HeuristicPolicy(5, max_k=12)
    observe(policy, outcome(chain(5), 5, 0.1))
    assert plan(policy, 64, OFFER).model_tokens == 7
    observe(policy, outcome(chain(7), 2, 0.1))
    assert plan(policy, 64, OFFER).model_tokens == 6
    observe(policy, outcome(Proposal(), 0, 0.1))  # a round that drafted nothing changes nothing
    assert plan(policy, 64, OFFER).model_tokens == 6
    for _ in range(10):
        observe(policy, outcome(chain(1), 0, 0.1))
    assert plan(policy, 64, OFFER).model_tokens == 1


def test_adaptive_measures_a_plain_step_first():
    policy = Planner.speculative(SpecConfig())
    assert plan(policy, 10, OFFER).is_plain
    observe(policy, outcome(Proposal(), 0, 0.1))
    assert plan(policy, 10, OFFER).model_tokens == SpecConfig().num_draft_tokens


def flat(n):
    return 0.100  # bf16 CPU / GPU: verifying a few tokens costs one step


def steep(n):
    return 0.100 * (1 + 0.5 * (n - 1))  # fp32 CPU: each extra token costs half a step


def test_adaptive_long_drafts_when_cheap_and_accepted():
    policy = Planner.speculative(SpecConfig(confidence_stop=False))
    feed(policy, 30, 8, 8, t_draft=0.01, t_verify=flat, plain_step=0.1)
    assert plan(policy, 12, OFFER).model_tokens >= 8


def test_adaptive_shorter_drafts_when_verification_is_expensive():
    config = SpecConfig(confidence_stop=False)  # compare the k chosen from average acceptance alone
    cheap, costly = Planner.speculative(config), Planner.speculative(config)
    for policy, t_verify in ((cheap, flat), (costly, steep)):
        observe(policy, outcome(Proposal(), 0, 0.1))
        for _ in range(15):  # every round keeps 2 tokens, every other one 4: the third is kept half the time
            feed(policy, 1, 6, 4, t_draft=0.02, t_verify=t_verify)
            feed(policy, 1, 6, 2, t_draft=0.02, t_verify=t_verify)
    assert 0 < plan(costly, 12, OFFER).model_tokens < plan(cheap, 12, OFFER).model_tokens


def test_adaptive_turns_off_when_it_does_not_pay_and_probes_later():
    config = SpecConfig(probe_interval=5, max_regret=1.0)  # a budget large enough for the probes
    policy = Planner.speculative(config)
    feed(policy, 10, 3, 0, t_draft=0.05, t_verify=flat, plain_step=0.1)  # nothing accepted, draft half a step
    assert plan(policy, 12, OFFER).is_plain
    for _ in range(config.probe_interval):
        observe(policy, outcome(Proposal(), 0, 0.1))
    assert plan(policy, 12, OFFER).model_tokens > 0  # probe
    observe(policy, outcome(chain(1, t_draft=0.05), 0, 0.1))
    assert plan(policy, 12, OFFER).is_plain


def plain_rounds_until_probe(policy, most=10_000):
    """(plain rounds before the next probe, the probe's plan)."""
    for n in range(most):
        planned = plan(policy, 12, OFFER)
        if planned.model_tokens:
            return n, planned
        observe(policy, outcome(Proposal(), 0, 0.1, planned))
    return most, None


def test_probes_back_off_and_stay_within_the_regret_budget():
    """A useless draft: each failed probe doubles the wait, and what probing loses stays under max_regret of the
    plain decoding time (here 3%)."""
    policy = Planner.speculative(SpecConfig(probe_interval=4))
    feed(policy, 1, 3, 0, t_draft=0.05, t_verify=flat, plain_step=0.1)  # one losing round: 0.15 s lost
    waits = []
    for _ in range(6):
        wait, probe = plain_rounds_until_probe(policy)
        assert probe.probe
        waits.append(wait)
        observe(policy, outcome(chain(1, t_draft=0.05), 0, 0.1, probe))  # the probe loses again
        assert policy.regret.lost <= 0.03 * policy.regret.plain_seconds + 1e-9
    # the first waits are set by the budget (0.05 s lost per probe needs 17 plain steps of 0.1 s at 3%), then
    # by the doubling interval
    assert waits[0] > 4 and all(later >= earlier for earlier, later in zip(waits[1:], waits[2:]))
    assert waits[-1] == 2 * waits[-2] and policy.exploration.interval == 2 * waits[-1]  # the last probe, too


def test_confident_rounds_run_longer_when_verification_is_cheap():
    """With confidence_stop the round length comes from the in-round rule: steep v(n) stops it sooner."""
    lengths = []
    for t_verify in (flat, steep):
        policy = Planner.speculative(SpecConfig())
        feed(policy, 30, 6, 5, t_draft=0.02, t_verify=t_verify, plain_step=0.1)
        round_plan = plan(policy, 16, OFFER)
        confidences = [0.9]
        while len(confidences) < round_plan.model_tokens and round_plan.rule.keep_drafting(confidences):
            confidences.append(0.9)
        lengths.append(len(confidences))
    assert lengths[0] > lengths[1]


def test_confidence_stop():
    policy = Planner.speculative(SpecConfig())
    feed(policy, 20, 6, 6, t_draft=0.02, t_verify=flat, plain_step=0.1, confidences=[0.99] * 6)
    rule = plan(policy, 12, OFFER).rule
    assert rule.keep_drafting([0.99])
    assert not rule.keep_drafting([0.99, 0.02])  # a token the draft itself doubts: the chain likely ends here


def test_confidence_is_calibrated_by_what_the_target_kept():
    """A draft that is confident but wrong: its 0.95 comes to mean far less than 0.95."""
    policy = Planner.speculative(SpecConfig())
    before = policy.rule().calibrated(0.95)
    feed(policy, 30, 4, 0, t_draft=0.02, t_verify=flat, plain_step=0.1, confidences=[0.95] * 4)
    assert before > 0.9 and policy.rule().calibrated(0.95) < 0.2


def test_make_policy():
    assert isinstance(make_policy(SpecConfig(policy="fixed")), FixedPolicy)
    assert isinstance(make_policy(SpecConfig(policy="heuristic")), HeuristicPolicy)
    assert isinstance(make_policy(SpecConfig()), Planner)


def test_lookup_tokens_follow_their_measured_acceptance():
    """Prompt-lookup tokens are appended while their learned acceptance pays for the measured verify cost."""
    good, bad = Planner.speculative(SpecConfig()), Planner.speculative(SpecConfig())
    for policy, kept in ((good, 8), (bad, 0)):
        feed(policy, 20, 4, 4, t_draft=0.02, t_verify=steep, plain_step=0.1)
        for _ in range(20):  # rounds whose 4 draft tokens were kept, and `kept` of 8 lookup tokens after them
            observe(policy, outcome(chain(4, lookup=8, t_draft=0.02), 4 + kept, steep(13)))
    assert plan(good, 16, OFFER).rule.lookup_tokens([0.95] * 4) >= 4
    assert plan(bad, 16, OFFER).rule.lookup_tokens([0.95] * 4) == 0
    assert plan(FixedPolicy(4), 16).rule is None  # fixed k: no lookup tail


def test_lookup_only_round_when_the_history_beats_the_draft():
    """An edit that copies its input: once lookup tokens prove always right, a round verifies the history's
    continuation without a draft forward, although the draft is good too."""
    policy = Planner.speculative(SpecConfig())
    feed(policy, 10, 4, 4, t_draft=0.01, t_verify=flat, plain_step=0.1)
    offer = Offer(candidates=(Candidate(tuple(range(20)), (SourceKind.LOOKUP, 0)),), model_tokens=64)
    assert plan(policy, 16, offer).model_tokens > 0  # the lookup's acceptance is unknown yet: its prior is 0.5
    for _ in range(10):
        observe(policy, outcome(Proposal.chain(range(10), [Source(SourceKind.LOOKUP, 0, j) for j in range(1, 11)]), 10, 0.1))
    round_plan = plan(policy, 16, offer)
    assert round_plan.model_tokens == 0 and round_plan.candidates[0].tokens == tuple(range(LEADING_LOOKUP))


def test_keep_drafting_when_a_draft_step_is_free_and_verifying_one_more_is_free():
    """A drafter whose steps cost nothing measurable (draft_time 0, or a coarse clock) on flat verify costs:
    a confident next token is free, so it is worth drafting; the rule says so instead of dividing by zero."""
    policy = Planner.speculative(SpecConfig())
    feed(policy, 5, 4, 4, t_draft=0.0, t_verify=flat, plain_step=0.1)
    rule = plan(policy, 16).rule
    assert rule.price.t_draft == 0.0
    assert rule.keep_drafting([0.99])


def test_a_batch_round_grows_to_at_most_twice_the_largest_measured_forward():
    """At B = 4 after a plain step (4 inputs measured) a flat extrapolation would make any k look free; the
    first drafting round reads at most 2 x 4 inputs (k = 1), the next at most twice what that measured."""
    policy = Planner.speculative(SpecConfig())
    views = [RowView(r, torch.arange(10), 64) for r in range(4)]
    assert all(p.is_plain for p in policy.plan(views, [OFFER] * 4))
    policy.observe([outcome(Proposal(), 0, 0.1) for _ in range(4)])  # forward_tokens 1 per row: 4 inputs
    policy.estimates.forward.observe(4, 0.1)
    assert {p.model_tokens for p in policy.plan(views, [OFFER] * 4)} == {1}
    policy.estimates.forward.observe(8, 0.1)
    assert {p.model_tokens for p in policy.plan(views, [OFFER] * 4)} == {3}


def test_a_draft_that_has_not_read_the_prompt_drafts_only_when_the_tokens_left_repay_the_read():
    """A batch of 8 prompts: the draft's prompt read, learned as slow as the target's (16 s), costs 16 s.
    Drafting k = 3 saves 0.1 - 0.18 / E a token; 64 tokens left cannot repay it (plain steps, and no probe
    that would pay it), 4096 can. Once the draft has read the prompts (setup 0), drafting pays again."""
    def run(remaining, setup_tokens):
        policy = Planner.speculative(SpecConfig(confidence_stop=False))
        policy.estimates.forward.observe(8, 0.10)  # a plain step of 8 rows
        for n in (16, 24, 32, 40):
            policy.estimates.forward.observe(n, 0.12)
        policy.estimates.draft_step.observe(1, 0.02)
        policy.observe_prefill(tokens=8 * 200, seconds=16.0)  # the target read the prompts in 16 s
        policy.estimates.draft_read.ratio.update(1.0)  # and the draft reads them as slowly: 16 s
        policy.learned(DRAFT).observe_slots([(i, True) for i in (1, 2, 3)] * 20)  # a well-accepted draft
        views = [RowView(r, torch.arange(201), remaining) for r in range(8)]
        offers = [Offer(model_tokens=remaining, setup_tokens=setup_tokens)] * 8
        plans = [policy.plan(views, offers) for _ in range(60)]  # long enough to reach a probe
        return {p.model_tokens for row_plans in plans for p in row_plans}

    assert run(64, setup_tokens=200) == {0}
    assert run(4096, setup_tokens=200) - {0}
    assert run(64, setup_tokens=0) - {0}


def test_the_draft_prompt_read_is_learned_as_a_share_of_the_target_prefill():
    """The target read 2 x 100 tokens in 2 s; the draft read them in 1 s (each row's share 0.5 s): a share of 0.5,
    which prices a later read of a 4 s prefill at 2 s."""
    policy = Planner.speculative(SpecConfig())
    views = [RowView(r, torch.arange(101), 64) for r in range(2)]
    policy.observe_prefill(tokens=200, seconds=2.0)
    policy.estimates.forward.observe(2, 0.1)
    policy.estimates.draft_step.observe(1, 0.02)
    plans = policy.plan(views, [Offer(model_tokens=64, setup_tokens=100)] * 2)
    drafted = dataclasses.replace(chain(1, t_draft=0.02), setup_time=0.5, setup_tokens=100)
    policy.observe([outcome(drafted, 1, 0.1, plans[0]), outcome(drafted, 1, 0.1, plans[1])])
    assert policy.estimates.draft_read.share() == 0.5
    assert policy.estimates.draft_read.estimate(4.0) == 2.0


def test_a_cold_first_read_cannot_switch_speculation_off_for_good():
    """The README path after a short call (issue 27): the short call's draft read (5 tokens) took 0.53 s, almost
    all of it the 4-bit kernels' one-time cold start, where the target read the same prompt in 0.06 s. Learned per
    token (0.106 s) it priced a later 300-token read at ~30 s, which 64 tokens could never repay, and no call
    drafted again. Priced as a share of the target's prefill, the cold sample (9x the parameter share) is not
    learned, and the next call's read of a 300-token prompt (prefill 0.9 s) is priced at a third of it: drafting
    pays."""
    estimates = Estimates()
    estimates.draft_read.prior = 1 / 3  # the draft's share of the target's parameters (0.5B / 1.5B)
    short = Planner.speculative(SpecConfig(), estimates)
    short.observe_prefill(tokens=5, seconds=0.06)
    assert short.estimates.draft_read.observe(0.53, 0.06) is False and estimates.draft_read.cold == 1
    policy, planned = first_plan_after_a_read(estimates, prefill_s=0.9, remaining=64, draft_step=0.03)  # next call
    assert planned.model_tokens > 0 and policy.read_seconds(300) == 0.3


def first_plan_after_a_read(estimates, *, prefill_s: float, remaining: int, draft_step: float):
    """A call on ``estimates`` whose target has just read a 300-token prompt in ``prefill_s``, with t(n) measured
    nearly flat (0.1 s a step) and a draft step of ``draft_step``: (its planner, its first plan)."""
    policy = Planner.speculative(SpecConfig(), estimates)
    policy.observe_prefill(tokens=300, seconds=prefill_s)
    for n, seconds in {1: 0.1, 2: 0.1, 4: 0.11, 8: 0.12}.items():
        policy.estimates.forward.observe(n, seconds)
    policy.estimates.draft_step.observe(1, draft_step)
    (planned,) = policy.plan([RowView(0, torch.arange(301), remaining)],
                             [Offer(model_tokens=remaining, setup_tokens=300)])
    return policy, planned


def test_a_read_priced_out_of_drafting_is_measured_again_by_a_later_call():
    """A learned share that blocks drafting (here a warm but slow sample) is an average, not a verdict: each call
    it blocked moves it halfway back to the prior, so a later call reads, and measures, again."""
    estimates = Estimates()
    estimates.draft_read.prior = 0.3
    estimates.draft_read.observe(draft_seconds=0.8, target_seconds=1.0)  # 0.8: under 3x the prior, learned
    calls = []
    for _ in range(6):
        policy, planned = first_plan_after_a_read(estimates, prefill_s=1.0, remaining=40, draft_step=0.02)
        calls.append(planned.model_tokens > 0)
        if not planned.model_tokens:
            assert planned.why.startswith("draft prompt read not repaid")
            policy.observe([outcome(Proposal(), 0, 0.1, planned)])
    assert calls[:2] == [False, True]  # 0.8 s to read: not repaid by 40 tokens; 0.55 s (halfway back): repaid


def test_planning_is_a_query():
    """``plan`` changes no state: the same inputs give the same plans, and the estimates are untouched."""
    policy = Planner.speculative(SpecConfig(probe_interval=1))
    feed(policy, 3, 3, 0, t_draft=0.05, t_verify=flat, plain_step=0.1)  # a draft that does not pay
    policy.regret.plain_seconds = 100.0  # earlier plain steps: a probe is affordable
    observe(policy, outcome(Proposal(), 0, 0.1, plan(policy, 12)))

    def curves():  # the cost curves' values, in fresh dicts of floats: a copy that planning cannot reach
        return {name: getattr(policy.estimates, name).table() for name in ("forward", "draft_step", "draft_rows")}

    before = (curves(), vars(policy.exploration).copy(), policy.regret.lost)
    assert before[0]["forward"] and before[0]["draft_step"]  # measured curves: a change to them would show
    first = [plan(policy, 12) for _ in range(5)]
    assert len(set(first)) == 1 and first[0].probe
    assert vars(policy.exploration) == before[1] and policy.regret.lost == before[2]
    assert curves() == before[0]


def test_a_draft_step_measured_on_smaller_batches_is_priced_at_this_batch_size():
    """A batch of 8 after calls of 4 rows: the draft step measured at 4 rows (0.05 s) costs what the target's
    steps say a batch twice as large costs, t(8) / t(4) = 2 times as much. Priced at 0.05 s, drafting k = 7
    would seem to repay the draft's 5 s prompt read twice over (``setup_margin``) within 128 tokens; priced at
    0.1 s it does not (plain steps), and within 256 tokens it does."""
    def run(remaining):
        policy = Planner.speculative(SpecConfig(confidence_stop=False))
        for n, seconds in {4: 0.10, 8: 0.20, 16: 0.22, 32: 0.25}.items():
            policy.estimates.forward.observe(n, seconds)
        policy.estimates.draft_step.observe(4, 0.05)
        policy.observe_prefill(tokens=8 * 63, seconds=5.04)  # the target read the prompts in 5.04 s
        policy.estimates.draft_read.ratio.update(1.0)  # the draft as slowly: 5.04 s
        policy.learned(DRAFT).observe_slots([(i, True) for i in range(1, 9)] * 20)
        views = [RowView(r, torch.arange(64), remaining) for r in range(8)]
        plans = policy.plan(views, [Offer(model_tokens=remaining, setup_tokens=63)] * 8)
        assert policy.price(8).t_draft == 0.1
        return {p.model_tokens for p in plans}

    assert run(128) == {0}
    # the most a batch of 8 may draft: rounds grow to twice the largest forward measured (2 x 32 / 8 inputs a row)
    assert run(256) == {7}


def test_a_batch_draft_step_is_priced_by_the_profiled_draft_step_by_rows():
    """The draft step was measured over 1 row only (52 ms); the target's t(n) is flat from 1 to 64 inputs (bf16
    with AMX), so scaled like the target a step over 8 rows would cost about as much as over 1, and drafting
    k = 3 at B = 8 would seem to repay the 5 s prompt read twice over (``setup_margin``) within 160 tokens. The hardware profile measured the
    draft step by rows (48 / 52 / 95 / 106 ms over 1 / 2 / 4 / 8 rows, a dynamic-int8 0.5B draft on an Intel Xeon
    with AMX): priced at 0.115 s over 8 rows, drafting does not repay the read (plain steps)."""
    def run(draft_rows):
        policy = Planner.speculative(SpecConfig(confidence_stop=False))
        for n, seconds in {1: 0.186, 8: 0.193, 16: 0.20, 32: 0.214, 64: 0.24}.items():
            policy.estimates.forward.observe(n, seconds)
        policy.estimates.draft_step.observe(1, 0.052)
        if draft_rows:
            policy.estimates.draft_rows = ForwardCost.from_table(draft_rows)
        policy.observe_prefill(tokens=8 * 63, seconds=5.04)  # the target read the prompts in 5.04 s
        policy.estimates.draft_read.ratio.update(1.0)  # the draft as slowly: 5.04 s
        policy.learned(DRAFT).observe_slots([(i, i < 4) for i in range(1, 5)] * 20)
        views = [RowView(r, torch.arange(64), 160) for r in range(8)]
        plans = policy.plan(views, [Offer(model_tokens=160, setup_tokens=63)] * 8)
        return round(policy.price(8).t_draft, 4), {p.model_tokens for p in plans}

    assert run(None) == (0.054, {3})  # a guess from the target's curve: 54 ms, and the read is paid
    assert run({1: 0.048, 2: 0.052, 4: 0.095, 8: 0.106}) == (0.1148, {0})


def test_a_batch_drafts_one_k_for_every_row_without_confidence_stops_or_lookup():
    """One row: the round may run to the cap and the in-round confidence stop decides, or a prompt-lookup
    continuation is verified alone. A batch of 4: one k* for every row from E(k) / T(k) at the batch's costs, no
    confidence stop, no lookup rounds or tails (the draft steps until its longest row stops and the forward is
    padded to its widest row; one k measured faster at every B > 1)."""
    def plans(rows, lookup):
        policy = Planner.speculative(SpecConfig())  # confidence_stop and history_lookup on (the defaults)
        for n, seconds in {1: 0.2, 2: 0.2, 4: 0.2, 8: 0.2, 12: 0.21, 16: 0.22, 20: 0.23, 24: 0.24, 32: 0.3,
                           64: 0.6}.items():
            policy.estimates.forward.observe(n, seconds)
        policy.estimates.draft_step.observe(rows, 0.02)
        policy.learned(DRAFT).observe_slots([(i, i < 6) for i in range(1, 7)] * 20)  # 5 tokens kept, the 6th not
        policy.learned(LOOKUP).observe_slots([(i, True) for i in range(1, 5)] * 40)  # lookup continuations kept
        candidates = (Candidate((5, 6, 7, 8), (SourceKind.LOOKUP, 0)),) if lookup else ()
        views = [RowView(r, torch.arange(32), 64) for r in range(rows)]
        return policy.plan(views, [Offer(model_tokens=64, candidates=candidates)] * rows)

    (one,) = plans(1, lookup=False)
    assert one.model_tokens == SpecConfig().max_draft_tokens and one.rule.confidence_stop
    assert plans(1, lookup=True)[0].candidates  # lookup alone beats drafting here
    batch = plans(4, lookup=True)
    assert {p.model_tokens for p in batch} == {5} and not any(p.candidates for p in batch)
    assert not any(p.rule for p in batch)  # no in-round rule: the draft steps on the device, read with the round


def rounds_length(rule, confidence=0.95, most=16):
    """How many tokens the in-round rule drafts when every draft token has this confidence."""
    confidences = [confidence]
    while len(confidences) < most and rule.keep_drafting(confidences):
        confidences.append(confidence)
    return len(confidences)


def test_a_profile_that_overprices_long_forwards_is_measured_once_speculation_has_paid():
    """A hardware profile priced forwards over 5+ inputs at four plain steps; here they cost one. While nothing
    has paid, the in-round rule believes the profile; once rounds have earned regret credit, a seeded size past
    the largest measured one is priced as the measured curve continues (what it could lose fits in the budget),
    the round runs past it, and that measurement replaces the seed instead of averaging with it."""
    seeded = {n: (0.1 if n <= 4 else 0.4) for n in (1, 2, 3, 4, 6, 8, 16, 32)}
    policy = Planner.speculative(SpecConfig(), Estimates(forward=ForwardCost.from_table(seeded, prior=True),
                                                    draft_step=ForwardCost.from_table({1: 0.02}, prior=True)))
    assert rounds_length(plan(policy, 16).rule) == 3  # no credit yet: 5 inputs priced by the profile
    feed(policy, 10, 3, 3, t_draft=0.02, t_verify=flat, confidences=[0.95] * 3)  # 4 tokens for 0.16 s, plain 0.4 s
    assert policy.regret.allowance() > 0.1
    assert rounds_length(plan(policy, 16).rule) > 4
    policy.regret.lost, policy.regret.plain_seconds = 0.0, 0.0  # the same estimates with no credit
    assert rounds_length(plan(policy, 16).rule) == 3
    observe(policy, outcome(chain(5), 5, 0.1))  # 6 inputs measured at one plain step
    assert policy.estimates.forward.estimate(6) == 0.1 and not policy.estimates.forward.seeded(6)


def test_a_copying_edit_verifies_the_lookup_alone_when_drafting_does_not_pay():
    """One planner for every source: a draft the target never agrees with (drafting does not pay) beside a
    prompt-lookup continuation the target always keeps. Before the planner was one, such rounds were plain
    steps; now the trie of ready-made candidates runs on its own rate, sized within the regret budget."""
    policy = Planner.speculative(SpecConfig())
    feed(policy, 6, 4, 0, t_draft=0.05, t_verify=steep, plain_step=0.1)  # every draft token rejected
    for _ in range(10):
        observe(policy, outcome(Proposal.chain(range(6), [Source(SourceKind.LOOKUP, 0, j) for j in range(1, 7)]),
                                6, steep(7)))
    offer = Offer(candidates=(Candidate(tuple(range(20)), (SourceKind.LOOKUP, 0)),), model_tokens=64)
    assert plan(policy, 64, Offer(model_tokens=64)).why.startswith("drafting does not pay")
    round_plan = plan(policy, 64, offer)
    assert round_plan.model_tokens == 0 and len(round_plan.candidates[0].tokens) >= 2


def test_every_planner_carries_its_regret_account_to_the_next_call_at_half():
    """One regret account, one rule for both drafters: a new call starts with half of the earlier calls'."""
    for make in (lambda e: Planner.speculative(SpecConfig(), e), lambda e: Planner.lookahead(LookaheadConfig(), e)):
        estimates = Estimates()
        estimates.regret.lost, estimates.regret.plain_seconds = -4.0, 20.0
        planner = make(estimates)
        assert (planner.regret.lost, planner.regret.plain_seconds) == (-2.0, 10.0)
        assert planner.regret is estimates.regret


def test_planning_ready_made_candidates_is_a_query():
    """A lookahead round's plan creates no estimator, moves no account: a source never observed is priced from
    its prior without being stored."""
    estimates = Estimates()
    for n, seconds in ((1, 0.1), (8, 0.1), (16, 0.11)):
        estimates.forward.observe(n, seconds)
    estimates.regret.plain_seconds = 100.0
    policy = Planner.lookahead(LookaheadConfig(), estimates)
    offers = [Offer(candidates=(Candidate((5, 6, 7), (SourceKind.HISTORY, 3)), Candidate((5, 8), (SourceKind.POOL, 0))))]
    views = [RowView(0, torch.arange(10), 32)]
    before = (set(estimates.acceptance), estimates.regret.lost, estimates.regret.plain_seconds, dict(estimates.emas))
    plans = [policy.plan(views, offers) for _ in range(3)]
    assert plans[0] == plans[1] == plans[2] and plans[0][0].candidates
    assert (set(estimates.acceptance), estimates.regret.lost, estimates.regret.plain_seconds, dict(estimates.emas)) == before


def test_a_round_that_cannot_lose_is_affordable_with_the_account_spent():
    """The regret account is spent (a draft's misses): a round of candidates whose worst case costs no more than
    a plain step (flat t(n)) still runs; where t(n) rises it waits for plain steps to earn the budget back."""
    def first_plan(costs):
        estimates = Estimates()
        for n, seconds in costs.items():
            estimates.forward.observe(n, seconds)
        estimates.regret.lost, estimates.regret.plain_seconds = 2.0, 10.0  # 2 s lost, 0.3 s allowed
        policy = Planner.lookahead(LookaheadConfig(), estimates)
        offer = Offer(candidates=(Candidate((5, 6, 7), (SourceKind.HISTORY, 4)),))
        return policy.plan([RowView(0, torch.arange(10), 32)], [offer])[0]

    assert first_plan({1: 0.1, 4: 0.1, 8: 0.1}).candidates
    assert first_plan({1: 0.1, 4: 0.2, 8: 0.3}).is_plain


def test_a_read_that_saves_nothing_says_so():
    """Where the best round's worst cost saves nothing over the tokens left, the reason says that, not a negative
    saving ("~-4.25 s saved", which the demo showed). t(1) = 0.10 s and t(2) = 0.15 s measured: the expected price
    is flat past 2 inputs, so a round of k > 0 is the best one, but at its worst (the slope continued: t(n) grows
    0.05 s an input) it costs more per token than a plain step."""
    policy = Planner.speculative(SpecConfig(confidence_stop=False))
    policy.estimates.forward.observe(1, 0.10)
    policy.estimates.forward.observe(2, 0.15)
    policy.estimates.draft_step.observe(1, 0.005)
    policy.estimates.draft_read.ratio.update(0.25)
    policy.observe_prefill(tokens=200, seconds=4.0)
    assert policy.decide(policy.price(), 3, 29, 200).why == (
        "draft prompt read not repaid: 1.00 s to read, nothing saved at the worst verify cost over the 29 tokens left")
    assert policy.decide(policy.price(), 3, 29, 0).k > 0  # with the prompt read, a round of the draft is the best


def test_a_read_that_is_slow_again_is_its_real_cost_and_prices_drafting_out():
    """Only one outlier is set aside as a cold start. A draft whose reads really cost four times the prior share
    (a bf16 draft on a CPU without bf16 units: 4.2 s for a 64-token read against a parameter share of 1/3) is
    learned from its second read: priced at the prior for good, every later call would read a prompt that its
    drafting never repays."""
    estimates = Estimates()
    estimates.draft_read.prior = 1 / 3
    assert estimates.draft_read.observe(1.2, 0.3) is False  # 4x the prior: set aside, as a cold start would be
    assert estimates.draft_read.observe(1.2, 0.3) is True  # slow again: the read's cost
    policy, planned = first_plan_after_a_read(estimates, prefill_s=0.9, remaining=64, draft_step=0.03)
    assert abs(policy.read_seconds(300) - 3.6) < 1e-9
    assert planned.model_tokens == 0 and "draft prompt read not repaid" in planned.why


def test_a_target_size_slow_again_replaces_its_seed():
    """A seeded size's first slow measurement is set aside (a cold start of that shape's kernels); the second is
    the size's cost, so a seed far below it (a profile from another load of the machine) cannot hold for good."""
    estimates = Estimates()
    estimates.forward = ForwardCost.from_table({1: 0.1, 8: 0.1}, prior=True)
    estimates.forward.observe(8, 0.5)
    assert estimates.forward.estimate(8) < 0.5 and estimates.forward.cold == 1
    estimates.forward.observe(8, 0.5)
    assert estimates.forward.estimate(8) == 0.5 and estimates.forward.cold == 1
