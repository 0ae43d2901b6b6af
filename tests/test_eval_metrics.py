"""Metrics: throughput aggregation, oracle bound on hand-made agreement, parity/divergence, KS."""

import math

import pytest

from eval import metrics


def _row(pid, mode, tokens, e2e, repeat=0, seed=0, **extra):
    return {"task": "t", "prompt_id": pid, "mode": mode, "repeat": repeat, "seed": seed, "new_tokens": tokens,
            "e2e_s": e2e, "ttft_s": 0.1, "tpot_s": (e2e - 0.1) / max(1, tokens - 1), **extra}


def test_throughput_is_total_tokens_over_total_time_not_mean_of_speeds():
    rows = [
        _row("a", "plain", 100, 10.0), _row("b", "plain", 10, 0.5),
        _row("a", "fast", 100, 5.0), _row("b", "fast", 10, 0.5),
    ]
    table = metrics.speed_table(rows, ["plain", "fast"])
    assert table["plain"]["tokens_per_s_median"] == pytest.approx(110 / 10.5)
    assert table["fast"]["tokens_per_s_median"] == pytest.approx(110 / 5.5)
    # a mean of per-prompt speeds would give (10 + 20) / 2 = 15 for plain: not what we report
    assert table["plain"]["tokens_per_s_median"] != pytest.approx(15.0)
    assert table["fast"]["speedup"] == pytest.approx((110 / 5.5) / (110 / 10.5))
    pp = table["fast"]["per_prompt_speedup"]
    assert sorted(table["fast"]["per_prompt_speedups"]) == pytest.approx([1.0, 2.0])
    assert pp["median"] == pytest.approx(1.5) and pp["geomean"] == pytest.approx(math.sqrt(2))
    assert pp["share_above_1"] == pytest.approx(0.5)


def test_repeats_summarised_by_min_and_median():
    rows = [_row("a", "plain", 10, t, repeat=i) for i, t in enumerate([1.0, 3.0, 2.0])]
    entry = metrics.speed_table(rows, ["plain"])["plain"]
    assert entry["tokens_per_s_median"] == pytest.approx(10 / 2.0)
    assert entry["tokens_per_s_min_time"] == pytest.approx(10 / 1.0)
    assert entry["n_rows"] == 3 and entry["n_prompts"] == 1
    assert entry["repeat_spread_median"] == pytest.approx((3.0 - 1.0) / 2.0)


def test_oracle_bound_hand_example():
    # runs: [T T] F | [T] F | F  -> rounds (draft 2, emit 3), (draft 1, emit 2), (draft 0, emit 1)
    agreement = [True, True, False, True, False, False]
    res = metrics.oracle_bound(agreement, c=0.1, v={1: 1.0, 2: 1.0, 3: 1.0})
    assert res["rounds"] == 3
    assert res["cost_steps"] == pytest.approx(1.2 + 1.1 + 1.0)
    assert res["speedup"] == pytest.approx(6 / 3.3)
    assert res["mean_accepted_length"] == pytest.approx(2.0)


def test_oracle_bound_with_growing_verify_cost_and_run_to_the_end():
    # [T T T] F | [T T] (end): rounds: draft 3 emit 4 (cost 3c + v(4)), draft 2 emit 2 (cost 2c + v(2))
    agreement = [True, True, True, False, True, True]
    v = {1: 1.0, 2: 1.1, 4: 1.3}  # v(3) is interpolated, not needed here
    res = metrics.oracle_bound(agreement, c=0.2, v=v)
    assert res["cost_steps"] == pytest.approx(0.6 + 1.3 + 0.4 + 1.1)
    assert res["speedup"] == pytest.approx(6 / 3.4)
    # all wrong: plain decoding, speedup 1
    assert metrics.oracle_bound([False] * 5, 0.3, v)["speedup"] == pytest.approx(1.0)
    # all right with free drafting: one round
    assert metrics.oracle_bound([True] * 4, 0.0, {1: 1.0, 4: 1.0})["speedup"] == pytest.approx(4.0)


def test_oracle_aggregate_is_total_over_total():
    agg = metrics.oracle_aggregate([[True, True, False], [False]], c=0.0, v={1: 1.0, 3: 1.0}, skip_first=False)
    assert agg["tokens"] == 4 and agg["speedup"] == pytest.approx(4 / 2)
    # by default the first token (from the prefill in every mode) is left out
    agg = metrics.oracle_aggregate([[True, True, False], [False]], c=0.0, v={1: 1.0, 3: 1.0})
    assert agg["tokens"] == 2 and agg["rounds"] == 1 and agg["speedup"] == pytest.approx(2.0)


def test_divergence_and_near_tie():
    assert metrics.divergence([1, 2, 3], [1, 2, 3], None, 0.5)["exact"]
    d = metrics.divergence([1, 2, 3, 4], [1, 2, 9, 4], [3.0, 2.0, 0.1, 5.0], 0.5)
    assert d == {"exact": False, "first_divergence": 2, "margin": 0.1, "numerical": True}
    d = metrics.divergence([1, 2, 3], [1, 7, 3], [3.0, 2.0, 0.1], 0.5)
    assert d["first_divergence"] == 1 and d["numerical"] is False
    # one output is a prefix of the other (e.g. stopped early)
    assert metrics.divergence([1, 2, 3], [1, 2], [1, 1, 1], 0.5)["first_divergence"] == 2
    assert metrics.tie_threshold("torch.bfloat16") == 0.5 and metrics.tie_threshold("float32") < 0.1


def test_ks_two_sample():
    same = metrics.ks_2samp(list(range(100)), list(range(100)))
    assert same["statistic"] == pytest.approx(0.0) and same["pvalue"] > 0.9
    shifted = metrics.ks_2samp(list(range(100)), [x + 60 for x in range(100)])
    assert shifted["statistic"] == pytest.approx(0.6) and shifted["pvalue"] < 1e-6


def test_spec_table_from_specstats_and_from_forward_counts():
    spec = {"rounds": 4, "new_tokens": 10, "drafted": 12, "accepted": 6, "acceptance_per_position": [0.75, 0.5, 0.25],
            "draft_time_s": 1.0, "verify_time_s": 2.0, "prefill_time_s": 0.5, "total_time_s": 4.0,
            "cost_ratio_c": 0.2, "verify_cost": {"1": 1.0, "4": 1.2}, "rounds_spec_off": 1,
            "draft_length_hist": {"3": 3, "0": 1}}
    rows = [_row("a", "specdec_fixed", 10, 1.0, spec=spec), _row("a", "hf_assisted", 12, 1.0, target_forwards=4)]
    table = metrics.spec_table(rows, ["specdec_fixed", "hf_assisted"])
    s = table["specdec_fixed"]
    assert s["mean_accepted_length"] == pytest.approx(2.5) and s["accepted_per_drafted"] == pytest.approx(0.5)
    assert s["draft_share"] == pytest.approx(0.25) and s["rounds_spec_off_share"] == pytest.approx(0.25)
    assert s["c"] == pytest.approx(0.2) and s["v"] == {"1": 1.0, "4": 1.2}
    assert table["hf_assisted"]["mean_accepted_length"] == pytest.approx(3.0)


def test_dedupe_prefers_success():
    rows = [dict(_row("a", "m", 1, 1.0), error="boom"), _row("a", "m", 2, 1.0)]
    assert metrics.dedupe(rows) == [rows[1]]


def test_acceptance_by_position_pools_raw_counts():
    a = {"rounds": 3, "new_tokens": 5, "drafted_per_position": [2, 1], "accepted_per_position": [2, 0]}
    b = {"rounds": 9, "new_tokens": 9, "drafted_per_position": [2], "accepted_per_position": [0]}
    rows = [_row("a", "m", 5, 1.0, spec=a), _row("b", "m", 9, 1.0, spec=b)]
    assert metrics.spec_table(rows, ["m"])["m"]["acceptance_per_position"] == pytest.approx([0.5, 0.0])


def test_fastest_plain_is_taken_prompt_by_prompt():
    """The docstring's worked example, plus a second prompt where the other dtype is the faster plain."""
    from eval.metrics import speed_table

    def row(pid, mode, tokens, seconds):
        return {"prompt_id": pid, "mode": mode, "seed": 0, "repeat": 0, "new_tokens": tokens, "e2e_s": seconds}

    rows = [row("p", "plain_bf16", 10, 2.0), row("p", "plain_fp32", 10, 1.6), row("p", "spec", 10, 1.0),
            row("q", "plain_bf16", 10, 1.0), row("q", "plain_fp32", 10, 3.0), row("q", "spec", 10, 2.0)]
    table = speed_table(rows, ["plain_bf16", "plain_fp32", "spec"], baseline="plain_bf16")
    per_prompt = table["spec"]["per_prompt_vs_fastest_plain"]
    assert per_prompt["max"] == pytest.approx(1.6) and per_prompt["min"] == pytest.approx(0.5)
    assert table["spec"]["vs_fastest_plain"] == pytest.approx((1.6 + 1.0) / (1.0 + 2.0))
    assert table["plain_fp32"]["per_prompt_vs_fastest_plain"]["min"] == pytest.approx(1 / 3)
    assert "vs_fastest_plain" not in speed_table(rows[:1] + rows[2:3], ["plain_bf16", "spec"], "plain_bf16")["spec"]
