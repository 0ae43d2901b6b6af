"""First calls, and calls after a short one (issue 27): the README path with no benchmark warm-up.

    python bench/first_call.py --out results/first_call                    # the bundled pair, every default
    python bench/first_call.py --out results/first_call_ab --old c8d4509   # + the older commit, same run
    python bench/first_call.py --tiny --limit 2 --out /tmp/fc              # smoke run, tiny random pair (seconds)

What a new user does: ``load_pair(target, draft)`` (``dtype="auto"``, ``draft_quantize="auto"``),
``hf_specdec.enable(model)``, then ``model.generate(**inputs, assistant_model=draft, max_new_tokens=64)``,
greedy, on held-out prompts (``bench/heldout.jsonl``: completions of standard-library-style functions from
their signature and docstring, and "rewrite this function" edits in the chat template; none from HumanEval).
Nothing is called before the first timed call but what that path calls, so the first call of the process is
a real first call. Modes, interleaved per prompt (a balanced order, ``eval/interleave.py``):

- ``plain``: transformers' own ``generate`` (``type(model).generate``, past ``enable``) in the dtype ``auto``
  chose; the reference every output is compared with.
- ``plain_other``: the target loaded in the other of bf16 / fp32, or dense fp32 where ``auto`` chose
  "fp32-packed" (``--no-other-dtype`` skips it). Speedups
  are over the faster plain dtype of each prompt (the per-prompt minimum of the two times), so the baseline
  is never slower than either dtype alone.
- ``plain_again``: ``plain`` a second time (A/A): how far two runs of the same code differ here.
- ``fresh``: as a script that calls ``generate`` once: ``enable(model)`` made anew for each prompt, so the call
  runs on the fresh ``SpeculativeMemory`` that ``enable`` gives (issue 27, case a), which that first call seeds
  from the cached hardware profile (its file reads are inside the timed call; each call's stats record where
  its first estimates came from, ``estimates_from``).
- ``after_short``: one ``enable(model)`` for the whole run; its ``model.speculative_memory`` is first used by a
  short call (``--short-tokens`` 8 tokens of ``--short-prompt``, as a demo, notebook or smoke test makes) right
  before this mode's first prompt, then by every prompt in turn (case b). The short call is timed and reported
  apart; it is not in the mode's totals.
- ``fresh_old`` / ``after_short_old`` (``--old COMMIT``): the same two from an older commit, exported with
  ``git archive`` and imported as ``hf_specdec_old`` (as ``bench/before_after.py``), over the same
  model objects, in the same interleaved run.

``--repeat N`` runs every mode N times a prompt, each time in the next balanced order, and sums the times: on
a shared 2-core machine one run of a prompt differs from the next by up to ~15% (the A/A column), more than the
worst-prompt bar allows. ``after_short`` gets a new ``enable`` and short call each repeat, so no call's memory
has seen its prompt before.

The first mode of ``--modes`` makes the process's first call (default ``fresh``); the JSON records which.
``load_pair`` measures the hardware profile once per machine and caches it (its forwards then run before the
first timed call; ``load.profile_measured_here`` lists them): run ``hf-specdec tune`` once first to time a
process after the first load, as every later script of a user is.

Greedy as eval's greedy: ``do_sample=False``, the target's other generation settings (its repetition penalty)
kept. Throughput is total new tokens / total seconds of a mode; "overall" speedup is that against the total
tokens / total seconds of the per-prompt fastest plain dtype; "worst prompt": the lowest per-prompt
speedup. ``--tiny``: ``tiny_pair()`` (``tiny_model("llama", seed=0)`` on the offline code tokenizer, whose chat
template the edit prompts need, and a noisy copy as draft), fp32 with a bf16 copy as ``plain_other``: a check
that the script runs, in seconds; its speedups mean nothing (the draft costs what the target costs).

The issue's bars (``fresh`` and ``after_short``): on a CPU with bf16 units (avx512_bf16 or amx_bf16)
>= 1.3x the fastest plain dtype overall; on any CPU >= 0.97x overall and >= 0.90x on the worst prompt; outputs
token-identical to ``plain``. ``--out DIR`` writes ``first_call.json`` (per prompt and mode: tokens, seconds,
speedup, hf_specdec's stats, identity with plain; the machine record and what ``auto`` chose) and
``first_call.md`` (the table printed at the end).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's hf_specdec and eval, not an installed copy

import torch  # noqa: E402

from eval.interleave import order as run_order  # noqa: E402
import hf_specdec  # noqa: E402
from old_commit import import_old  # noqa: E402  (bench/, beside this script)

PROMPTS = ROOT / "bench" / "heldout.jsonl"
SPEC_MODES = ("fresh", "after_short", "fresh_old", "after_short_old")
BAR_MODES = ("fresh", "after_short")
BF16_BAR, OVERALL_BAR, WORST_BAR = 1.3, 0.97, 0.90


def git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                              text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine_of(dtype: str | None = None) -> dict:
    """The machine record every preset reports (``hardware.machine_record``), with whether the CPU has bf16 units,
    its AMX flags, and the hf_specdec it ran (path, commit, uncommitted changes)."""
    from hf_specdec.models.hardware import cpu_flags, cpu_has_bf16, machine_record

    record = machine_record(dtype=dtype)
    record.update(bf16_units=cpu_has_bf16(), amx=sorted(f for f in cpu_flags() if f.startswith("amx")),
                  hf_specdec_path=str(Path(hf_specdec.__file__).parent),
                  commit=git("rev-parse", "HEAD"), dirty=bool(git("status", "--porcelain", "--", "hf_specdec")))
    return record


def machine_words(machine) -> str:
    """The machine record (``machine()``) as every preset's table line gives it: CPU kind, flags, threads, versions."""
    return (f"{machine['cpu_model']} ({', '.join(machine['cpu_flags']) or 'no listed flags'}; bf16 units: "
            f"{'yes' if machine['bf16_units'] else 'no'}), {machine['torch_threads']} threads, torch "
            f"{machine['torch']}, transformers {machine['transformers']}")


def write_report(out, name: str, report: dict, table: str) -> None:
    """``OUT/<name>.json`` (the whole report) and ``OUT/<name>.md`` (the table printed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(jsonable(report), indent=1))
    (out / f"{name}.md").write_text(table + "\n")
    print(f"wrote {out / (name + '.json')} and {out / (name + '.md')}", file=sys.stderr)


def jsonable(value):
    """Stats values (Counters, tuples, dataclasses, int keys) as JSON."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if hasattr(value, "to_dict"):
        return jsonable(value.to_dict())
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return jsonable(dataclasses.asdict(value))
    return str(value)


def stats_record(stats) -> dict | None:
    """What the issue asks of a call's ``last_spec_stats``: rounds, drafted, accepted, rounds with speculation
    off, where its first estimates came from, and ``plain_reasons`` where the stats object has them (read with
    getattr: not every commit has them)."""
    if stats is None:
        return None
    record = {name: getattr(stats, name, None) for name in
              ("rounds", "forwards", "new_tokens", "drafted", "accepted", "rounds_spec_off", "fell_back",
               "draft_forwards", "draft_setup_time_s", "draft_time_s", "verify_time_s", "prefill_time_s",
               "estimates_from", "estimates_why")}
    record["package"] = type(stats).__module__.split(".")[0]  # hf_specdec or hf_specdec_old: which code ran
    record["mean_accepted_length"] = getattr(stats, "mean_accepted_length", None)
    hist = getattr(stats, "draft_length_hist", None)
    record["draft_length_hist"] = dict(sorted(hist.items())) if hist else {}
    reasons = getattr(stats, "plain_reasons", None)
    if reasons is not None:
        record["plain_reasons"] = reasons
    return jsonable(record)


# -- models and prompts -----------------------------------------------------------------------------------------
def load_models(args):
    """``(model, other, draft, tokenizer, load)``: the target as ``auto`` loaded it, the target in the other of
    bf16/fp32 (None with --no-other-dtype), the draft, the tokenizer and what was chosen."""
    from hf_specdec.models.formats import model_format

    if args.tiny:
        from hf_specdec.models.tiny import tiny_pair

        model, draft, tokenizer = tiny_pair(seed=0)  # tiny_model("llama", seed=0) on the code tokenizer, noisy copy
        load = {"target": {"ref": "tiny", "dtype": "float32", "why": "--tiny: fp32 random model"},
                "draft": {"ref": "tiny (perturbed copy)", "dtype": "float32", "quantize": None}}
        other = None if args.no_other_dtype else copy.deepcopy(model).to(torch.bfloat16)
    else:
        from hf_specdec.models import load_model, load_pair

        from hf_specdec.models.bundles import resolve_cache_dir

        profiles = resolve_cache_dir() / "profiles"
        before = {p.name: p.stat().st_mtime for p in profiles.glob("*.json")} if profiles.is_dir() else {}
        start = time.perf_counter()
        (model, tokenizer, info), (draft, _, draft_info) = load_pair(args.target, args.draft)  # the README's call
        seconds = time.perf_counter() - start
        measured = sorted(p.name for p in profiles.glob("*.json") if before.get(p.name) != p.stat().st_mtime) \
            if profiles.is_dir() else []
        load = {"target": {**jsonable(_info(info))}, "draft": {**jsonable(_info(draft_info))},
                "load_pair_s": round(seconds, 2),
                # profile entries measured in this process (its forwards ran before the first timed call);
                # empty: the profile came from the cache, as in every process after the first load
                "profile_measured_here": measured}
        other = None
        if not args.no_other_dtype:
            # a packed target's other: the dense fp32 model, transformers' own fp32 path (what a user has without
            # hf_specdec); a dense target's: the other of bf16 / fp32
            other_dtype = "fp32" if info.dtype == "bfloat16" or info.quantize == "fp32-packed" else "bf16"
            other, _, other_info = load_model(args.target, dtype=other_dtype)
            load["other"] = jsonable(_info(other_info))
    load["target"]["format"] = model_format(model)
    load["draft"]["format"] = model_format(draft)
    if other is not None:
        load.setdefault("other", {})["format"] = model_format(other)
    for m in (model, other):
        if m is not None:  # greedy: every mode decodes the same argmax path (eval's greedy settings)
            m.generation_config.do_sample = False
            m.generation_config.temperature = m.generation_config.top_k = m.generation_config.top_p = None
    return model, other, draft, tokenizer, load


def _info(info) -> dict:
    return {"ref": info.ref, "kind": info.kind, "dtype": info.dtype, "quantize": info.quantize,
            "device": info.device, "load_time_s": round(info.load_time_s, 2), "why": info.why}


def load_prompts(path: Path, tokenizer, limit: int | None):
    """eval's ``jsonl:PATH`` task (chat rows rendered with the tokenizer's chat template), encoded as eval does."""
    from eval.tasks import load_task

    samples = load_task(f"jsonl:{path}", tokenizer, limit)
    return [(s.id, s.style, tokenizer(s.text, return_tensors="pt", add_special_tokens=s.style != "chat"))
            for s in samples]


# -- the run ------------------------------------------------------------------------------------------------------
class Runner:
    """Every mode as one callable ``run(mode, inputs) -> (new token ids, seconds, stats)``; hf_specdec's modes
    go through ``model.generate`` of an ``enable``d model, as the README's user does."""

    def __init__(self, args, model, other, draft, tokenizer, packages):
        self.args, self.model, self.other, self.draft, self.tokenizer = args, model, other, draft, tokenizer
        self.packages = packages  # {"": hf_specdec, "_old": hf_specdec_old}
        self.enabled_by = None
        self.sessions: dict[str, tuple] = {}  # after_short mode (#repeat) -> (speculative_memory, lookahead_memory)
        self.short: dict[str, dict] = {}
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.common = dict(do_sample=False, pad_token_id=pad)

    def _enable(self, package, session=None):
        """``package.enable(model)`` made anew; with ``session``, the memories a run's one ``enable`` made."""
        if self.enabled_by is not None:
            self.enabled_by.disable(self.model)
        package.enable(self.model)
        self.enabled_by = package
        if session is not None:
            self.model.speculative_memory, self.model.lookahead_memory = session

    def _timed(self, call, inputs, max_new_tokens):
        start = time.perf_counter()
        out = call(**inputs, max_new_tokens=max_new_tokens, **self.common)
        seconds = time.perf_counter() - start
        return out[0, inputs["input_ids"].shape[1]:].tolist(), seconds

    def run(self, mode: str, inputs, rep: int = 0):
        args, model = self.args, self.model
        if mode in ("plain", "plain_again"):
            return (*self._timed(lambda **kw: type(model).generate(model, **kw), inputs, args.new_tokens), None)
        if mode == "plain_other":
            other = self.other
            return (*self._timed(lambda **kw: type(other).generate(other, **kw), inputs, args.new_tokens), None)
        package = self.packages["_old" if mode.endswith("_old") else ""]
        if mode.startswith("fresh"):
            self._enable(package)  # a script: enable(model), then generate once
        else:
            key = mode if rep == 0 else f"{mode}#{rep + 1}"  # each repeat its own memory: none sees a prompt twice
            if key not in self.sessions:  # the run's (the repeat's) one enable, first used by a short call
                self._enable(package)
                self.sessions[key] = (model.speculative_memory, model.lookahead_memory)
                short = self.tokenizer(args.short_prompt, return_tensors="pt")
                model.last_spec_stats = None
                tokens, seconds = self._timed(lambda **kw: model.generate(**kw, assistant_model=self.draft),
                                              short, args.short_tokens)
                self.short[key] = {"prompt": args.short_prompt, "tokens": len(tokens), "seconds": round(seconds, 4),
                                    "stats": stats_record(getattr(model, "last_spec_stats", None))}
            else:
                self._enable(package, self.sessions[key])
        model.last_spec_stats = None
        tokens, seconds = self._timed(lambda **kw: model.generate(**kw, assistant_model=self.draft), inputs,
                                      args.new_tokens)
        return tokens, seconds, stats_record(getattr(model, "last_spec_stats", None))


def summarize(records, modes, baseline_modes):
    """Per mode: tokens, seconds, tok/s, speedup over the fastest plain dtype overall (total tokens / total time
    against the per-prompt fastest plain's total tokens / total time), worst prompt, identity with plain."""
    base_tokens = sum(r["fastest_plain"]["tokens"] for r in records)
    base_seconds = sum(r["fastest_plain"]["seconds"] for r in records)
    base_rate = base_tokens / base_seconds if base_seconds else 0.0
    summary = {"fastest_plain": {"tokens": base_tokens, "seconds": round(base_seconds, 3),
                                 "tok_s": round(base_rate, 3),
                                 "dtype_count": {m: sum(r["fastest_plain"]["mode"] == m for r in records)
                                                 for m in baseline_modes}}}
    for mode in modes:
        tokens = sum(r["modes"][mode]["tokens"] for r in records)
        seconds = sum(r["modes"][mode]["seconds"] for r in records)
        rate = tokens / seconds if seconds else 0.0
        per_prompt = [r["modes"][mode]["speedup"] for r in records]
        worst = min(range(len(records)), key=lambda i: per_prompt[i])
        entry = {"tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(rate, 3),
                 "speedup": round(rate / base_rate, 4) if base_rate else None,
                 "worst_prompt": round(per_prompt[worst], 4), "worst_prompt_id": records[worst]["id"],
                 "identical_to_plain": f"{sum(r['modes'][mode]['identical_to_plain'] for r in records)}"
                                       f"/{len(records)}"}
        if mode in SPEC_MODES:
            stats = [s or {} for r in records for s in [r["modes"][mode]["stats"], *r["modes"][mode].get(
                "stats_repeats", [])]]
            for key in ("rounds", "drafted", "accepted", "rounds_spec_off"):
                entry[key] = sum(s.get(key) or 0 for s in stats)
            entry["calls_never_drafted"] = sum(1 for s in stats if not s.get("drafted"))
            origins: dict[str, int] = {}  # where each call's first estimates came from (commits that record it)
            for s in stats:
                origin = s.get("estimates_from") or "not recorded"
                origins[origin] = origins.get(origin, 0) + 1
            entry["first_estimates"] = origins
            if any("plain_reasons" in s for s in stats):  # summed over the prompts (commits that record them)
                reasons: dict[str, int] = {}
                for s in stats:
                    for kind, count in (s.get("plain_reasons") or {}).items():
                        reasons[kind] = reasons.get(kind, 0) + count
                entry["plain_reasons"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1]))
        summary[mode] = entry
    if "plain" in summary and "plain_again" in summary and summary["plain"]["tok_s"]:
        summary["plain_again"]["vs_plain"] = round(summary["plain_again"]["tok_s"] / summary["plain"]["tok_s"], 4)
    return summary


def bars(summary, has_bf16_units: bool) -> dict:
    result = {}
    for mode in BAR_MODES + tuple(m for m in ("fresh_old", "after_short_old") if m in summary):
        if mode not in summary:
            continue
        s = summary[mode]
        checks = {f"overall >= {OVERALL_BAR}": s["speedup"] >= OVERALL_BAR,
                  f"worst prompt >= {WORST_BAR}": s["worst_prompt"] >= WORST_BAR,
                  "token-identical": s["identical_to_plain"].split("/")[0] == s["identical_to_plain"].split("/")[1]}
        if has_bf16_units:
            checks[f"overall >= {BF16_BAR} (bf16 units)"] = s["speedup"] >= BF16_BAR
        result[mode] = {"checks": checks, "pass": all(checks.values())}
    return result


def markdown(report) -> str:
    s, machine = report["summary"], report["machine"]
    repeats = f", each mode {report['repeat']} times a prompt (times summed)" if report["repeat"] > 1 else ""
    lines = [f"first_call: {report['prompts']} held-out prompts, {report['new_tokens']} new tokens{repeats}, greedy; "
             f"{machine_words(machine)}; target "
             f"{report['load']['target'].get('format')}, draft {report['load']['draft'].get('format')} (auto)",
             f"fastest plain dtype per prompt: {s['fastest_plain']['tok_s']:.2f} tok/s "
             f"({', '.join(f'{m} {n}' for m, n in s['fastest_plain']['dtype_count'].items())} prompts)", "",
             "| mode | tok/s | speedup vs fastest plain dtype | worst prompt | token-identical | rounds spec off / "
             "rounds | calls never drafted | first estimates (calls) | bars |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode in report["modes"]:
        e = s[mode]
        off = f"{e['rounds_spec_off']}/{e['rounds']}" if "rounds" in e else "–"
        never = str(e["calls_never_drafted"]) if "calls_never_drafted" in e else "–"
        origins = ", ".join(f"{kind} {count}" for kind, count in e["first_estimates"].items()) \
            if "first_estimates" in e else "–"
        bar = report["bars"].get(mode)
        verdict = "–" if bar is None else ("PASS" if bar["pass"] else "FAIL: " + ", ".join(
            k for k, ok in bar["checks"].items() if not ok))
        extra = f" (A/A: {e['vs_plain']:.3f}x plain)" if "vs_plain" in e else ""
        lines.append(f"| {mode} | {e['tok_s']:.2f} | {e['speedup']:.3f}x{extra} | {e['worst_prompt']:.3f}x "
                     f"({e['worst_prompt_id']}) | {e['identical_to_plain']} | {off} | {never} | {origins} | "
                     f"{verdict} |")
    for mode in report["modes"]:
        if s[mode].get("plain_reasons"):
            lines.append(f"\n{mode}: rounds with speculation off by reason: " + ", ".join(
                f"{kind} {count}" for kind, count in s[mode]["plain_reasons"].items()))
    for mode, short in report["short_calls"].items():
        lines.append(f"\n{mode}: the short call ({short['tokens']} tokens of {short['prompt']!r}) took "
                     f"{short['seconds']:.3f} s, not counted above; spec off in "
                     f"{(short['stats'] or {}).get('rounds_spec_off')}/{(short['stats'] or {}).get('rounds')} rounds")
    first = report["first_call"]
    lines.append(f"\nfirst call of the process: {first['mode']} on {first['id']} ({first['seconds']:.3f} s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    from hf_specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--prompts", default=str(PROMPTS), help="eval's jsonl task format (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--short-tokens", type=int, default=8, help="the short call's new tokens (after_short)")
    parser.add_argument("--short-prompt", default="def add(a, b):")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-other-dtype", action="store_true", help="skip plain in the other of bf16/fp32")
    parser.add_argument("--old", default=None, help="an older commit: adds fresh_old and after_short_old")
    parser.add_argument("--modes", default=None, help="comma-separated subset and order (default: all)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every mode N times per prompt, the next balanced order each time; times summed")
    parser.add_argument("--tiny", action="store_true", help="tiny random pair: a smoke run of the script")
    parser.add_argument("--out", default=None, help="folder for first_call.json and first_call.md")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="hf_specdec_old_") as tmp:
        packages = {"": hf_specdec}
        if args.old:
            packages["_old"] = import_old(args.old, Path(tmp))
        model, other, draft, tokenizer, load = load_models(args)
        prompts = load_prompts(Path(args.prompts), tokenizer, args.limit)
        default = ["fresh", "after_short", *(["fresh_old", "after_short_old"] if args.old else []), "plain",
                   *(["plain_other"] if other is not None else []), "plain_again"]
        modes = args.modes.split(",") if args.modes else default
        unknown = [m for m in modes if m not in default]
        if unknown or "plain" not in modes:
            parser.error(f"--modes: {unknown or 'plain is required'} (available: {','.join(default)})")
        baseline_modes = [m for m in ("plain", "plain_other") if m in modes]
        runner = Runner(args, model, other, draft, tokenizer, packages)
        records, first = [], None
        for i, (pid, style, inputs) in enumerate(prompts):
            results, orders = {}, []
            for rep in range(args.repeat):  # each repeat takes the next order: pairs drift less
                order = run_order(modes, i * args.repeat + rep)
                orders.append(order)
                for mode in order:
                    tokens, seconds, stats = runner.run(mode, inputs, rep)
                    first = first or {"mode": mode, "id": pid, "seconds": seconds}
                    r = results.setdefault(mode, {"tokens": 0, "seconds": 0.0, "output": tokens, "runs": [],
                                                  "stats": stats, "same_each_run": True})
                    r["tokens"] += len(tokens)
                    r["seconds"] = round(r["seconds"] + seconds, 4)
                    r["runs"].append(round(seconds, 4))
                    r["same_each_run"] &= tokens == r["output"]
                    if rep:
                        r.setdefault("stats_repeats", []).append(stats)
            reference = results["plain"]["output"]
            fastest = min(baseline_modes, key=lambda m: results[m]["seconds"] / max(1, results[m]["tokens"]))
            base_rate = results[fastest]["tokens"] / results[fastest]["seconds"]
            for mode, r in results.items():
                r["tok_s"] = round(r["tokens"] / r["seconds"], 3)
                r["speedup"] = round(r["tokens"] / r["seconds"] / base_rate, 4)
                r["identical_to_plain"] = r["output"] == reference and r.pop("same_each_run")
            records.append({"id": pid, "style": style, "prompt_tokens": int(inputs["input_ids"].shape[1]),
                            "order": orders[0] if args.repeat == 1 else orders,
                            "fastest_plain": {"mode": fastest, **{k: results[fastest][k] for k in
                                                                  ("tokens", "seconds")}},
                            "modes": {m: results[m] for m in modes}})
            print(f"{pid}: " + ", ".join(f"{m} {results[m]['speedup']:.2f}x" for m in modes), file=sys.stderr,
                  flush=True)
        short_calls = runner.short

    machine = machine_of(load["target"].get("dtype"))
    summary = summarize(records, modes, baseline_modes)
    report = {"preset": "first_call", "issue": 27, "argv": sys.argv[1:] if argv is None else list(argv),
              "old": args.old, "tiny": args.tiny, "prompts": len(records), "prompt_file": args.prompts,
              "new_tokens": args.new_tokens, "repeat": args.repeat, "short_tokens": args.short_tokens, "modes": modes,
              "baseline": "per prompt, the faster of " + " / ".join(baseline_modes),
              "machine": machine, "load": load, "summary": summary,
              "bars": bars(summary, machine["bf16_units"]), "short_calls": short_calls, "first_call": first,
              "records": records}
    table = markdown(report)
    print(table)
    if args.out:
        write_report(args.out, "first_call", report, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
