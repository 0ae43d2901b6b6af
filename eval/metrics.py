"""Pure functions from rows to numbers: speed aggregation, speculation metrics, oracle bound, parity, KS test.

Definitions (used everywhere in the report)
-------------------------------------------
* throughput of a mode = total new tokens / total end-to-end seconds over all its prompts (never a mean of
  per-prompt speeds, which over-weights short, fast outputs). Repeats are summarised per (prompt, mode) by the
  min and the median end-to-end time; "median" throughput = sum of tokens / sum of per-prompt median times.
* speedup of a mode = its median throughput / plain's median throughput. The per-prompt speedup is plain's
  median time per token / the mode's median time per token on that prompt; its distribution (min, p10, median,
  p90, max, geometric mean, share > 1) is reported beside the aggregate.
* TTFT = time from the call to the first streamed new token; TPOT = (e2e - TTFT) / (tokens - 1).
* mean accepted length = new tokens / target forwards (prefill included, bonus token included); plain has 1.
* c = cost of one draft forward / one target forward (1 token each); v(n) = cost of a target forward over n new
  tokens / over 1.
* oracle bound: see :func:`oracle_bound`.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any, Iterable, Mapping

from hf_specdec.costmodel import Bound, ForwardCost, RoundCost

# --- small helpers -------------------------------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float | None:
    """Linear-interpolated quantile (numpy's default), None for an empty list."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, Any]:
    pos = [v for v in values if v and v > 0]
    return {
        "n": len(values),
        "min": min(values) if values else None,
        "p10": quantile(values, 0.1),
        "median": quantile(values, 0.5),
        "p90": quantile(values, 0.9),
        "max": max(values) if values else None,
        "geomean": math.exp(sum(math.log(v) for v in pos) / len(pos)) if pos else None,
        "share_above_1": (sum(v > 1 for v in values) / len(values)) if values else None,
    }


def _median(values: Iterable[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def dedupe(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per key (last successful one wins); error rows only where no success exists."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["task"], str(row["prompt_id"]), row["mode"], int(row["repeat"]), int(row["seed"]))
        if key not in best or best[key].get("error") or not row.get("error"):
            best[key] = row
    return list(best.values())


PROMPT_LOOKUP = "hf_prompt_lookup"

# --- speed ---------------------------------------------------------------------------------------------------


def per_prompt(rows: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """(prompt_id, mode, seed) -> tokens and min/median over repeats of e2e, ttft, tpot."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if not r.get("error"):
            groups[(str(r["prompt_id"]), r["mode"], int(r["seed"]))].append(r)
    out = {}
    for key, rs in groups.items():
        e2e = [r["e2e_s"] for r in rs]
        tokens = statistics.median([r["new_tokens"] for r in rs])
        out[key] = {
            "tokens": tokens,
            "e2e_min": min(e2e),
            "e2e_median": statistics.median(e2e),
            "ttft_median": _median(r.get("ttft_s") for r in rs),
            "tpot_median": _median(r.get("tpot_s") for r in rs),
            "repeats": len(rs),
            # spread of the repeats, (max - min) / median: the timing noise on this machine
            "e2e_spread": (max(e2e) - min(e2e)) / statistics.median(e2e) if len(rs) > 1 else None,
        }
    return out


def speed_table(rows: list[dict[str, Any]], modes: list[str], baseline: str = "plain") -> dict[str, dict[str, Any]]:
    """Per mode: throughput (total tokens / total time; min and median over repeats), latency, memory, speedups
    over ``baseline`` (aggregate and per prompt) and, when it ran, over transformers' prompt lookup."""
    pp = per_prompt(rows)
    table: dict[str, dict[str, Any]] = {}
    for mode in modes:
        items = {k: v for k, v in pp.items() if k[1] == mode}
        mode_rows = [r for r in rows if r["mode"] == mode and not r.get("error")]
        if not items:
            table[mode] = {"n_prompts": 0}
            continue
        tokens = sum(v["tokens"] for v in items.values())
        t_min = sum(v["e2e_min"] for v in items.values())
        t_med = sum(v["e2e_median"] for v in items.values())
        mem = [r.get("peak_mem_bytes") for r in mode_rows if r.get("peak_mem_bytes")]
        table[mode] = {
            "n_prompts": len(items),
            "n_rows": len(mode_rows),
            "total_tokens": tokens,
            "total_time_median_s": t_med,
            "tokens_per_s_median": tokens / t_med if t_med else None,
            "tokens_per_s_min_time": tokens / t_min if t_min else None,  # best repeat per prompt
            "tokens_per_s_all_rows": sum(r["new_tokens"] for r in mode_rows) / sum(r["e2e_s"] for r in mode_rows),
            "ttft_median_s": _median(v["ttft_median"] for v in items.values()),
            "tpot_median_s": _median(v["tpot_median"] for v in items.values()),
            "e2e_median_s": _median(v["e2e_median"] for v in items.values()),
            "repeat_spread_median": _median(v["e2e_spread"] for v in items.values()),
            "peak_mem_bytes": max(mem) if mem else None,
            "mem_kind": mode_rows[0].get("mem_kind") if mode_rows else None,
        }
    base = table.get(baseline, {})
    for mode, entry in table.items():
        if not entry.get("n_prompts") or not base.get("n_prompts"):
            continue
        entry["speedup"] = entry["tokens_per_s_median"] / base["tokens_per_s_median"]
        entry["speedup_min_time"] = entry["tokens_per_s_min_time"] / base["tokens_per_s_min_time"]
        ratios = []
        for (pid, m, seed), v in pp.items():
            if m != mode:
                continue
            b = pp.get((pid, baseline, seed))
            if b and v["tokens"] and b["tokens"]:
                ratios.append((b["e2e_median"] / b["tokens"]) / (v["e2e_median"] / v["tokens"]))
        entry["per_prompt_speedup"] = distribution(ratios)
        entry["per_prompt_speedups"] = ratios
    fastest_plain(table, pp)
    lookup = table.get(PROMPT_LOOKUP, {})
    if lookup.get("n_prompts"):  # the draft-free reference lookahead is measured against
        for entry in table.values():
            if entry.get("n_prompts"):
                entry["speedup_vs_prompt_lookup"] = entry["tokens_per_s_median"] / lookup["tokens_per_s_median"]
    return table


def is_plain(mode: str) -> bool:
    """``plain`` and the ``plain_<dtype>`` modes: plain decoding, whatever the target's dtype."""
    return mode == "plain" or mode.startswith("plain_")


def fastest_plain(table: dict[str, dict[str, Any]], pp: dict[tuple, dict[str, Any]]) -> None:
    """When plain decoding ran in more than one dtype (``plain_bf16``, ``plain_fp32``, ...), add to every mode
    its speed against the *fastest plain decoding of each prompt*: ``vs_fastest_plain`` (total tokens / total
    time against the sum over prompts of the fastest plain time) and ``per_prompt_vs_fastest_plain``.

    Worked example: prompt p, plain_bf16 10 tokens in 2.0 s, plain_fp32 10 tokens in 1.6 s, a mode 10 tokens
    in 1.0 s: the fastest plain is 0.16 s/token and the mode's per-prompt ratio is 0.16 / 0.10 = 1.6x.
    """
    plains = [m for m in table if is_plain(m) and table[m].get("n_prompts")]
    if len(plains) < 2:
        return
    best: dict[tuple[str, int], float] = {}  # (prompt, seed) -> fastest plain seconds per token
    for (pid, mode, seed), v in pp.items():
        if is_plain(mode) and v["tokens"]:
            per_token = v["e2e_median"] / v["tokens"]
            best[(pid, seed)] = min(best.get((pid, seed), per_token), per_token)
    for mode, entry in table.items():
        if not entry.get("n_prompts"):
            continue
        ratios, tokens, seconds, plain_seconds = [], 0.0, 0.0, 0.0
        for (pid, m, seed), v in pp.items():
            if m == mode and v["tokens"] and (pid, seed) in best:
                ratios.append(best[(pid, seed)] / (v["e2e_median"] / v["tokens"]))
                tokens += v["tokens"]
                seconds += v["e2e_median"]
                plain_seconds += best[(pid, seed)] * v["tokens"]
        if ratios:
            entry["vs_fastest_plain"] = plain_seconds / seconds
            entry["per_prompt_vs_fastest_plain"] = distribution(ratios)


# --- speculation ---------------------------------------------------------------------------------------------


def spec_table(rows: list[dict[str, Any]], modes: list[str]) -> dict[str, dict[str, Any]]:
    """Per mode: mean accepted length (tokens / target forwards), acceptance by position, draft/verify split,
    c and v(k) as reported by hf_specdec, share of rounds with speculation off."""
    table = {}
    for mode in modes:
        rs = [r for r in rows if r["mode"] == mode and not r.get("error")]
        if not rs:
            continue
        tokens = sum(r["new_tokens"] for r in rs)
        specs = [r["spec"] for r in rs if r.get("spec")]
        entry: dict[str, Any] = {}
        if specs:
            rounds = sum(s.get("rounds") or 0 for s in specs)
            entry["mean_accepted_length"] = sum(s.get("new_tokens") or 0 for s in specs) / rounds if rounds else None
            entry["source"] = "SpecStats"
            entry["rounds"] = rounds
            entry["drafted"] = sum(s.get("drafted") or 0 for s in specs)
            entry["accepted"] = sum(s.get("accepted") or 0 for s in specs)
            entry["accepted_per_drafted"] = entry["accepted"] / entry["drafted"] if entry["drafted"] else None
            # acceptance per position i: of all rounds (all calls) that drafted >= i tokens, the share that
            # accepted the i-th -- from the raw counts when SpecStats has them, else rounds-weighted curves
            acc: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
            for s in specs:
                if s.get("drafted_per_position") is not None and s.get("accepted_per_position") is not None:
                    for i, (a, d) in enumerate(zip(s["accepted_per_position"], s["drafted_per_position"])):
                        acc[i][0] += a
                        acc[i][1] += d
                    continue
                w = s.get("rounds") or 1
                for i, a in enumerate(s.get("acceptance_per_position") or []):
                    if a is not None:
                        acc[i][0] += a * w
                        acc[i][1] += w
            entry["acceptance_per_position"] = [acc[i][0] / acc[i][1] if acc[i][1] else None for i in sorted(acc)]
            for key in ("draft_time_s", "verify_time_s", "prefill_time_s", "total_time_s"):
                vals = [s.get(key) for s in specs if s.get(key) is not None]
                entry[key] = sum(vals) if vals else None
            if entry.get("total_time_s"):
                for key in ("draft_time_s", "verify_time_s", "prefill_time_s"):
                    if entry.get(key) is not None:
                        entry[key.replace("_time_s", "_share")] = entry[key] / entry["total_time_s"]
            entry["c"] = _median(s.get("cost_ratio_c") for s in specs)
            vk: dict[str, list[float]] = defaultdict(list)
            for s in specs:
                for n, v in (s.get("verify_cost") or {}).items():
                    vk[str(n)].append(v)
            entry["v"] = {n: statistics.median(v) for n, v in sorted(vk.items(), key=lambda kv: int(kv[0]))}
            off = sum(s.get("rounds_spec_off") or 0 for s in specs)
            entry["rounds_spec_off"] = off
            entry["rounds_spec_off_share"] = off / rounds if rounds else None
            hist: dict[str, int] = defaultdict(int)
            for s in specs:
                for k, v in (s.get("draft_length_hist") or {}).items():
                    hist[str(k)] += v
            entry["draft_length_hist"] = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
        else:
            forwards = sum(r.get("target_forwards") or 0 for r in rs)
            entry["mean_accepted_length"] = tokens / forwards if forwards else None
            entry["source"] = "forward hook (tokens / target forwards)"
            entry["rounds"] = forwards
        table[mode] = entry
    return table


def verify_cost_curve(v: Mapping[int, float]) -> ForwardCost:
    """v(n) from measured points as the core's one cost curve (``ForwardCost``): v(1) = 1 by definition, sizes
    n >= 2 made monotone, linear in between (priced at ``Bound.WORST``: the slope of the two largest points
    continued past them)."""
    table = {int(k): float(x) for k, x in v.items()}
    table.setdefault(1, 1.0)
    return ForwardCost.from_table(table)


def oracle_bound(agreement: list[bool], c: float, v: Mapping[int, float]) -> dict[str, Any]:
    """Speedup of a perfect stop rule for this draft, in units of one plain target step.

    ``agreement[i]`` = the draft's argmax equals the target's token i (teacher forced over the plain greedy
    output). The oracle drafts exactly the run of tokens the draft gets right and then stops: a maximal run of r
    correct tokens followed by a wrong one is one round that drafts r tokens and emits r + 1 (the r accepted plus
    the target's own token), costing ``r * c + v(r + 1)``; a run that reaches the end of the sequence emits r and
    costs ``r * c + v(r)``. Plain decoding costs 1 per token, so speedup = tokens / sum of round costs.
    (r = 0 is a plain step: v(1) = 1.) Each round is priced by the core's one price (``costmodel.RoundCost``).
    """
    price = RoundCost(verify_cost_curve(v), t_draft=c)
    n = len(agreement)
    i, cost, rounds = 0, 0.0, 0
    runs = []
    while i < n:
        r = 0
        while i + r < n and agreement[i + r]:
            r += 1
        if i + r < n:
            emitted, verified = r + 1, r + 1
        else:
            emitted, verified = r, r
        cost += price.round(r, extra=verified - r - 1, bound=Bound.WORST)
        rounds += 1
        runs.append(r)
        i += emitted
    return {
        "tokens": n,
        "rounds": rounds,
        "cost_steps": cost,
        "speedup": n / cost if cost else None,
        "mean_accepted_length": n / rounds if rounds else None,
        "agreement_rate": sum(agreement) / n if n else None,
    }


def oracle_aggregate(per_prompt_agreement: list[list[bool]], c: float, v, skip_first: bool = True) -> dict[str, Any]:
    """Oracle over a whole run: total plain steps / total oracle cost (the same aggregation as throughput).

    ``skip_first``: the first new token comes from the prefill in every mode (the draft cannot help there), so
    the bound is taken over tokens 1.. only.
    """
    if skip_first:
        per_prompt_agreement = [a[1:] for a in per_prompt_agreement]
    parts = [oracle_bound(a, c, v) for a in per_prompt_agreement if a]
    tokens = sum(p["tokens"] for p in parts)
    cost = sum(p["cost_steps"] for p in parts)
    rounds = sum(p["rounds"] for p in parts)
    agree = sum(sum(a) for a in per_prompt_agreement)
    return {
        "tokens": tokens,
        "rounds": rounds,
        "speedup": tokens / cost if cost else None,
        "mean_accepted_length": tokens / rounds if rounds else None,
        "agreement_rate": agree / tokens if tokens else None,
        "per_prompt_speedups": [p["speedup"] for p in parts],
        "c": c,
        "v": {str(k): x for k, x in v.items()} if isinstance(v, Mapping) else None,
    }


# --- quality parity ------------------------------------------------------------------------------------------


def tie_threshold(dtype: str) -> float:
    """Logit margin under which a greedy divergence is called numerical (a near-tie), by dtype."""
    dtype = str(dtype).replace("torch.", "")
    return {"bfloat16": 0.5, "float16": 0.25, "float32": 0.01}.get(dtype, 0.5)


def divergence(plain_ids: list[int], mode_ids: list[int], margins: list[float] | None, threshold: float) -> dict:
    """Token-exact comparison with plain greedy; where they first differ, the target's top1-top2 logit margin
    (from one target forward over the plain sequence) and whether it is a near-tie (margin < threshold)."""
    if plain_ids == mode_ids:
        return {"exact": True, "first_divergence": None, "margin": None, "numerical": None}
    pos = next((i for i, (a, b) in enumerate(zip(plain_ids, mode_ids)) if a != b), min(len(plain_ids), len(mode_ids)))
    margin = margins[pos] if margins is not None and pos < len(margins) else None
    return {
        "exact": False,
        "first_divergence": pos,
        "margin": margin,
        "numerical": (margin < threshold) if margin is not None else None,
    }


def ks_2samp(a: list[float], b: list[float]) -> dict[str, Any]:
    """Two-sample Kolmogorov-Smirnov test (scipy when installed, else the asymptotic formula)."""
    if not a or not b:
        return {"statistic": None, "pvalue": None, "n": (len(a), len(b)), "method": "n/a"}
    try:
        from scipy.stats import ks_2samp as _ks

        res = _ks(a, b)
        return {"statistic": float(res.statistic), "pvalue": float(res.pvalue), "n": (len(a), len(b)),
                "method": "scipy"}
    except ImportError:
        pass
    xs, ys = sorted(a), sorted(b)
    n, m = len(xs), len(ys)
    d, i, j = 0.0, 0, 0
    while i < n and j < m:
        x = min(xs[i], ys[j])
        while i < n and xs[i] <= x:
            i += 1
        while j < m and ys[j] <= x:
            j += 1
        d = max(d, abs(i / n - j / m))
    en = math.sqrt(n * m / (n + m))
    lam = (en + 0.12 + 0.11 / en) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return {"statistic": d, "pvalue": min(1.0, max(0.0, p)), "n": (n, m), "method": "asymptotic"}


def pass_at_1(results: list[bool]) -> float | None:
    """pass@1 with one sample per (prompt, seed): the mean success (averaged over seeds for sampling)."""
    return sum(results) / len(results) if results else None
