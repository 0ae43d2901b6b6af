"""Draft-model trees (issue 28): ``SpecConfig(tree="auto")`` against ``"off"`` (the chain) and ``"on"``.

    python bench/trees.py --limit 3 --new-tokens 32 --out results/trees     # the bundled pair, auto dtype/format
    python bench/trees.py --tiny --limit 2 --new-tokens 16                   # smoke run, tiny random pair

The bundled pair as ``load_pair`` loads it (``dtype="auto"``, ``draft_quantize="auto"``), greedy, held-out prompts
(``bench/heldout.jsonl``, not HumanEval), modes interleaved per prompt in a balanced order (``eval/interleave.py``):

- ``plain``: transformers' own ``generate``; the reference every output is compared with;
- ``off`` / ``auto`` / ``on``: hf_specdec with ``SpecConfig(tree=...)``, each on its own ``SpeculativeMemory``
  (carried over the prompts, as ``enable``'s is), first used by one short warm-up call that is not timed;
- ``flat_off`` / ``flat_on`` (``--flat``): the same with the planner's prices frozen flat (every target forward
  priced as one step, every draft forward as one draft step, whatever was measured): what the rounds would do
  where t(n) is flat (a GPU, a CPU with bf16 units). Their wall time on a CPU where t(n) is steep says nothing;
  their tokens per target forward and acceptance by depth and rank are the point.

Per mode: tokens per second, speedup over plain (total tokens / total seconds against plain's), tokens per
target forward (``SpecStats.tokens_per_forward``), tree rounds and nodes verified, acceptance by depth and rank,
identity with plain. ``--out DIR`` writes ``trees.json`` and ``trees.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's hf_specdec and eval, not an installed copy

from eval.interleave import order as run_order  # noqa: E402
import hf_specdec  # noqa: E402
from first_call import git, load_prompts, machine_of, write_report  # noqa: E402  (bench/, beside this script)
from hf_specdec.costmodel import ForwardCost  # noqa: E402

PROMPTS = ROOT / "bench" / "heldout.jsonl"
TREE_MODES = {"off": "off", "auto": "auto", "on": "on", "flat_off": "off", "flat_on": "on"}


class FrozenCost(ForwardCost):
    """A cost curve that learns nothing once made: the what-if prices of the ``flat_*`` modes (a bench device,
    never used by the library)."""

    def __init__(self, seconds: float, largest: int = 128) -> None:
        super().__init__()
        for n in range(1, largest + 1):
            super().observe(n, seconds)

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass


def flat_memory(draft, step: float, draft_step: float) -> hf_specdec.SpeculativeMemory:
    memory = hf_specdec.SpeculativeMemory()
    estimates = memory.estimates(draft)
    estimates.forward, estimates.draft_step = FrozenCost(step), FrozenCost(draft_step)
    estimates.draft_rows = FrozenCost(draft_step)
    estimates.draft_read.prior = 0.0  # the draft's prompt read priced free: the what-if drafts from the start
    return memory


def stats_record(stats) -> dict:
    record = {name: getattr(stats, name) for name in
              ("rounds", "forwards", "new_tokens", "drafted", "accepted", "rounds_spec_off", "tree_rounds",
               "tree_nodes", "draft_forwards", "draft_time_s", "verify_time_s", "draft_setup_time_s")}
    record["tokens_per_forward"] = round(stats.tokens_per_forward, 4)
    record["judged_by_depth_rank"] = {f"{d}/{r}": n for (d, r), n in sorted(stats.judged_by_depth_rank.items())}
    record["accepted_by_depth_rank"] = {f"{d}/{r}": n for (d, r), n in sorted(stats.accepted_by_depth_rank.items())}
    record["plain_reasons"] = dict(stats.plain_reasons)
    return record


def load(args):
    if args.tiny:
        from hf_specdec.models.tiny import tiny_pair

        model, draft, tokenizer = tiny_pair(seed=0)
        return model, draft, tokenizer, {"target": "tiny fp32", "draft": "tiny fp32 (perturbed copy)"}
    from hf_specdec.models import load_pair

    (model, tokenizer, info), (draft, _, draft_info) = load_pair(args.target, args.draft)
    model.generation_config.do_sample = False
    model.generation_config.temperature = model.generation_config.top_k = model.generation_config.top_p = None
    return model, draft, tokenizer, {"target": f"{info.ref} {info.dtype} ({info.why})",
                                     "draft": f"{draft_info.ref} {draft_info.quantize or draft_info.dtype} "
                                              f"({draft_info.why})"}


def main(argv=None) -> int:
    from hf_specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--prompts", default=str(PROMPTS))
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--flat", action="store_true", help="add flat_off and flat_on (prices frozen flat)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    model, draft, tokenizer, loaded = load(args)
    hf_specdec.enable(model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = dict(do_sample=False, pad_token_id=pad)
    prompts = load_prompts(Path(args.prompts), tokenizer, args.limit)
    modes = ["plain", "off", "auto", "on"] + (["flat_off", "flat_on"] if args.flat else [])
    memories = {mode: hf_specdec.SpeculativeMemory() for mode in ("off", "auto", "on")}

    def call(mode, inputs, tokens):
        if mode == "plain":
            return type(model).generate(model, **inputs, max_new_tokens=tokens, **common), None
        out = model.generate(**inputs, assistant_model=draft, max_new_tokens=tokens, speculative_memory=memories[mode],
                             spec_config=hf_specdec.SpecConfig(tree=TREE_MODES[mode]), **common)
        return out, model.last_spec_stats.get()

    warm = tokenizer("def add(a, b):", return_tensors="pt")
    warmups = {}
    for mode in ("plain", "off", "auto", "on"):  # one short call each: measures the costs, reads nothing timed
        start = time.perf_counter()
        call(mode, warm, 8)
        warmups[mode] = round(time.perf_counter() - start, 3)
    if args.flat:  # frozen at one step of the target and of the draft, as the warm-up measured them
        measured = memories["off"].estimates(draft)
        step = measured.forward.estimate(1) or 1.0
        draft_step = measured.draft_step.estimate(1) or 0.1 * step
        for mode in ("flat_off", "flat_on"):
            memories[mode] = flat_memory(draft, step, draft_step)
        loaded["flat_prices"] = {"step_s": round(step, 4), "draft_step_s": round(draft_step, 4)}

    records = []
    for i, (pid, style, inputs) in enumerate(prompts):
        order = run_order(modes, i)
        results = {}
        for mode in order:
            start = time.perf_counter()
            out, stats = call(mode, inputs, args.new_tokens)
            seconds = time.perf_counter() - start
            tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
            results[mode] = {"tokens": len(tokens), "seconds": round(seconds, 4), "output": tokens,
                             "stats": None if stats is None else stats_record(stats)}
        for mode in modes:
            results[mode]["identical_to_plain"] = results[mode]["output"] == results["plain"]["output"]
        records.append({"id": pid, "style": style, "order": order, "modes": results})
        print(f"{pid}: " + ", ".join(f"{m} {results[m]['tokens'] / results[m]['seconds']:.2f} tok/s" for m in modes),
              file=sys.stderr, flush=True)

    summary = {}
    plain_rate = sum(r["modes"]["plain"]["tokens"] for r in records) / sum(r["modes"]["plain"]["seconds"]
                                                                           for r in records)
    for mode in modes:
        tokens = sum(r["modes"][mode]["tokens"] for r in records)
        seconds = sum(r["modes"][mode]["seconds"] for r in records)
        entry = {"tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 3),
                 "vs_plain": round(tokens / seconds / plain_rate, 4),
                 "identical": f"{sum(r['modes'][mode]['identical_to_plain'] for r in records)}/{len(records)}"}
        stats = [r["modes"][mode]["stats"] for r in records if r["modes"][mode]["stats"]]
        if stats:
            for key in ("rounds", "forwards", "new_tokens", "drafted", "accepted", "rounds_spec_off", "tree_rounds",
                        "tree_nodes"):
                entry[key] = sum(s[key] for s in stats)
            rows = len(stats)  # one row a call: the prefill's token and round left out
            entry["tokens_per_forward"] = round((entry["new_tokens"] - rows) / max(1, entry["rounds"] - rows), 3)
            judged, kept = {}, {}
            for s in stats:
                for key, n in s["judged_by_depth_rank"].items():
                    judged[key] = judged.get(key, 0) + n
                for key, n in s["accepted_by_depth_rank"].items():
                    kept[key] = kept.get(key, 0) + n
            entry["acceptance_by_depth_rank"] = {key: f"{kept.get(key, 0)}/{n}" for key, n in judged.items()}
        summary[mode] = entry

    report = {"preset": "trees", "issue": 28, "argv": sys.argv[1:] if argv is None else list(argv),
              "prompts": len(records), "new_tokens": args.new_tokens, "modes": modes, "load": loaded,
              "warmup_s": warmups, "machine": machine_of(), "commit": git("rev-parse", "HEAD"),
              "summary": summary, "records": records}
    lines = [f"trees: {len(records)} held-out prompts, {args.new_tokens} new tokens, greedy; target {loaded['target']}; "
             f"draft {loaded['draft']}", "",
             "| mode | tok/s | vs plain | tokens per target forward | tree rounds / rounds | nodes per tree round | "
             "rounds spec off | identical |", "|---|---|---|---|---|---|---|---|"]
    for mode in modes:
        e = summary[mode]
        if "rounds" not in e:
            lines.append(f"| {mode} | {e['tok_s']:.2f} | 1.000x | 1.00 | – | – | – | {e['identical']} |")
            continue
        per_tree = f"{e['tree_nodes'] / e['tree_rounds']:.1f}" if e["tree_rounds"] else "–"
        lines.append(f"| {mode} | {e['tok_s']:.2f} | {e['vs_plain']:.3f}x | {e['tokens_per_forward']:.2f} | "
                     f"{e['tree_rounds']} / {e['rounds']} | {per_tree} | {e['rounds_spec_off']} | {e['identical']} |")
    for mode in modes:
        if summary[mode].get("acceptance_by_depth_rank"):
            lines.append(f"\n{mode}: kept / judged by depth/rank: " + ", ".join(
                f"{key} {value}" for key, value in summary[mode]["acceptance_by_depth_rank"].items()))
    table = "\n".join(lines)
    print(table)
    if args.out:
        write_report(args.out, "trees", report, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
