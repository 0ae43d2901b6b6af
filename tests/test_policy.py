"""Draft-length policies, fed made-up measurements."""

from hf_specdec.config import SpecConfig
from hf_specdec.policy import AdaptivePolicy, FixedPolicy, HeuristicPolicy, make_policy, speedup_bound


def feed(policy, rounds, k, accepted, t_draft, t_verify, plain_step=None):
    """Simulate rounds that draft k tokens and accept `accepted` (cost: t_draft per draft forward, t_verify(n))."""
    if plain_step is not None:
        policy.observe(0, 0, 0.0, 0, 1, plain_step)
    for _ in range(rounds):
        policy.next_k(64)
        policy.observe(k, accepted, k * t_draft, k, k + 1, t_verify(k + 1))


def test_fixed():
    policy = FixedPolicy(5)
    assert policy.next_k(10) == 5 and policy.next_k(3) == 3


def test_heuristic_is_transformers_rule_without_the_empty_round_quirk():
    policy = HeuristicPolicy(5, max_k=12)
    policy.observe(5, 5, 0, 5, 6, 0)
    assert policy.next_k(64) == 7
    policy.observe(7, 2, 0, 7, 8, 0)
    assert policy.next_k(64) == 6
    policy.observe(0, 0, 0, 0, 1, 0)  # a round that drafted nothing changes nothing
    assert policy.next_k(64) == 6
    for _ in range(10):
        policy.observe(1, 0, 0, 1, 2, 0)
    assert policy.next_k(64) == 1


def test_adaptive_measures_a_plain_step_first():
    policy = AdaptivePolicy(SpecConfig())
    assert policy.next_k(10) == 0
    policy.observe(0, 0, 0, 0, 1, 0.1)
    assert policy.next_k(10) == SpecConfig().num_draft_tokens


def flat(n):
    return 0.100  # bf16 CPU / GPU: verifying a few tokens costs one step


def steep(n):
    return 0.100 * (1 + 0.5 * (n - 1))  # fp32 CPU: each extra token costs half a step


def test_adaptive_long_drafts_when_cheap_and_accepted():
    policy = AdaptivePolicy(SpecConfig())
    feed(policy, 30, 8, 8, t_draft=0.01, t_verify=flat, plain_step=0.1)
    assert policy.next_k(12) >= 8


def test_adaptive_shorter_drafts_when_verification_is_expensive():
    config = SpecConfig(confidence_stop=False)  # compare the k chosen from average acceptance alone
    cheap, costly = AdaptivePolicy(config), AdaptivePolicy(config)
    feed(cheap, 30, 6, 4, t_draft=0.02, t_verify=flat, plain_step=0.1)
    feed(costly, 30, 6, 4, t_draft=0.02, t_verify=steep, plain_step=0.1)
    assert costly.next_k(12) < cheap.next_k(12)


def test_adaptive_turns_off_when_it_does_not_pay_and_probes_later():
    config = SpecConfig(probe_interval=5)
    policy = AdaptivePolicy(config)
    feed(policy, 30, 3, 0, t_draft=0.05, t_verify=flat, plain_step=0.1)  # nothing accepted, draft half a step
    assert policy.next_k(12) == 0
    for _ in range(config.probe_interval):
        policy.observe(0, 0, 0.0, 0, 1, 0.1)
    assert policy.next_k(12) > 0  # probe
    policy.observe(1, 0, 0.05, 1, 2, 0.1)
    assert policy.next_k(12) == 0


def test_confident_rounds_run_longer_when_verification_is_cheap():
    """With confidence_stop the round length comes from the in-round rule: steep v(n) stops it sooner."""
    lengths = []
    for t_verify in (flat, steep):
        policy = AdaptivePolicy(SpecConfig())
        feed(policy, 30, 6, 5, t_draft=0.02, t_verify=t_verify, plain_step=0.1)
        cap = policy.next_k(16)
        drafted = 1
        while drafted < cap and policy.keep_drafting(drafted, 0.9):
            drafted += 1
        lengths.append(drafted)
    assert lengths[0] > lengths[1]


def test_confidence_stop():
    policy = AdaptivePolicy(SpecConfig())
    feed(policy, 20, 6, 6, t_draft=0.02, t_verify=flat, plain_step=0.1)
    policy.next_k(12)
    assert policy.keep_drafting(1, 0.99)
    assert not policy.keep_drafting(2, 0.02)  # a token the draft itself doubts: the chain likely ends here


def test_make_policy():
    assert isinstance(make_policy(SpecConfig(policy="fixed")), FixedPolicy)
    assert isinstance(make_policy(SpecConfig()), AdaptivePolicy)


def test_speedup_bound_matches_leviathan_table():
    # Leviathan et al. Thm 3.8; e.g. alpha=0.8, c=0.05 -> k*=8, S≈3.09
    assert abs(speedup_bound(0.8, 0.05, 8) - 3.09) < 0.01
    assert speedup_bound(0.8, 0.05, 8) > speedup_bound(0.8, 0.05, 4)


def test_lookup_tokens_follow_their_measured_acceptance():
    """Prompt-lookup tokens are appended while their learned acceptance pays for the measured verify cost."""
    good, bad = AdaptivePolicy(SpecConfig()), AdaptivePolicy(SpecConfig())
    for policy, kept in ((good, 8), (bad, 0)):
        feed(policy, 20, 4, 4, t_draft=0.02, t_verify=steep, plain_step=0.1)
        for _ in range(20):
            policy.observe_lookup(8, kept)
        policy.next_k(16)
        for i in range(1, 5):
            policy.keep_drafting(i, 0.95)
    assert good.free_tokens(5, 16) >= 4
    assert bad.free_tokens(5, 16) == 0
    assert FixedPolicy(4).free_tokens(5, 16) == 0
