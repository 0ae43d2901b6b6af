"""Early-exit self-drafting on the bundled target (issue 29): what its first N layers cost and how often they agree.

    python bench/early_exit.py --out results/early_exit                      # N = 4, 8, 12 of 28, 4 prompts, 32 tokens
    python bench/early_exit.py --layers 8 --limit 2 --new 32 --out /tmp/ee   # a shorter run
    python bench/early_exit.py --tiny --out /tmp/ee_tiny                     # smoke run, tiny random model (seconds)

The target (Qwen2.5-Coder-1.5B-Instruct, ``--dtype`` fp32 by default) drafts for itself with its first N decoder
layers, its final norm and its output layer (``hf_specdec.drafters.early_exit``; no second copy of any weight).
On held-out prompts (``bench/heldout.jsonl``, the first ``--limit``, completions and chat edits alternating), per N:

- ``c``: one draft step over one draft step of the target itself: both timed as the drafter runs them (one token
  on a cache holding the prompt, the median of ``--steps``), the draft with the narrowed output layer it uses by
  default (``SpecConfig.draft_vocab_size="auto"``: 32768 rows of 151936) and with the full one (``c_full``);
- greedy acceptance: the share of plain greedy's new tokens that the first N layers predict from the same prefix
  (one teacher-forced forward over prompt + plain's output, the hidden state after layer N through the final
  norm and the output layer; reported for every depth, not only the N timed). A greedy draft's tokens are accepted up to its first miss, and every accepted
  prefix is plain's, so this is exactly the chance that a draft token is accepted given those before it were;
- the best round it allows (``costmodel.best_round`` over that acceptance, c, and a flat t(n) up to 13 inputs:
  the most optimistic verify cost): draft length k and expected speedup over plain steps;
- ``adaptive``: ``generate(..., assistant_early_exit=N)`` with every default (the adaptive policy, prompt lookup
  beside the draft; one ``enable`` for the whole run, so later prompts start from what earlier ones measured for
  the same N): tokens/s against plain, and the draft tokens it judged and kept;
- ``fixed4`` (``--fixed``): the same with the fixed policy (4 draft tokens every round, no prompt lookup):
  what drafting costs when it is never turned off.

Modes are interleaved per prompt (plain first, then every N), each checked token-identical to plain greedy
(``type(model).generate``). Speedups: total new tokens / total seconds of a mode over plain's. ``--out DIR``
writes ``early_exit.json`` and ``early_exit.md`` (the table printed at the end).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's hf_specdec and eval, not an installed copy

import torch  # noqa: E402

import hf_specdec  # noqa: E402
from hf_specdec import cache as kv  # noqa: E402
from hf_specdec.drafters.draft_model import SubVocabHead  # noqa: E402
from hf_specdec.drafters.early_exit import early_exit_model  # noqa: E402

PROMPTS = ROOT / "bench" / "heldout.jsonl"
TARGET = "qwen2.5-coder-1.5b-instruct"
NARROW = 32768  # SpecConfig.draft_vocab_size="auto" for a vocabulary past 65536


def load(args):
    if args.tiny:
        from hf_specdec.models.tiny import code_tokenizer, tiny_model

        tokenizer = code_tokenizer()
        model = tiny_model("llama", seed=0, vocab=len(tokenizer), num_hidden_layers=6)
        return model, tokenizer, {"ref": "tiny llama, 6 layers", "dtype": "fp32"}
    from hf_specdec.models.loading import load_model

    model, tokenizer, info = load_model(TARGET, dtype=args.dtype)
    return model, tokenizer, {"ref": info.ref, "dtype": info.dtype, "why": info.why}


def load_prompts(tokenizer, limit: int):
    """eval's ``jsonl:PATH`` task (chat rows rendered with the tokenizer's chat template), encoded as eval does;
    completions and edits alternating."""
    from eval.tasks import load_task

    samples = load_task(f"jsonl:{PROMPTS}", tokenizer, None)
    completions = [s for s in samples if s.style != "chat"]
    edits = [s for s in samples if s.style == "chat"]
    mixed = [s for pair in zip(completions, edits) for s in pair][:limit]
    return [(s.id, tokenizer(s.text, return_tensors="pt", add_special_tokens=s.style != "chat")["input_ids"])
            for s in mixed]


@torch.no_grad()
def step_seconds(model, ids: torch.Tensor, steps: int, head=None) -> float:
    """Median seconds of one one-token forward on a cache holding ``ids`` (as a drafter steps: ``call_model``)."""
    cache = kv.new_cache(model)
    kv.call_model(model, ids[:, :-1], cache, head=head)
    token = ids[:, -1:]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        kv.call_model(model, token, cache, head=head)
        times.append(time.perf_counter() - start)
        kv.rollback(cache, ids.shape[1] - 1)
    return statistics.median(times)


def costs(model, ids: torch.Tensor, layers: list[int], steps: int) -> dict:
    vocab = model.get_output_embeddings().weight.shape[0]
    target = step_seconds(model, ids, steps)
    found = {"target_step_s": target}
    for n in layers:
        view = early_exit_model(model, n)
        keep = torch.unique(torch.cat([torch.arange(min(NARROW, vocab)), ids[0]]))
        narrow = SubVocabHead(view, keep, vocab) if vocab > 65536 else None
        full = step_seconds(view, ids, steps)
        found[n] = {"c": step_seconds(view, ids, steps, head=narrow) / target if narrow else full / target,
                    "c_full": full / target}
    return found


@torch.no_grad()
def agreement(model, ids: torch.Tensor, new: torch.Tensor) -> dict[int, tuple[int, int]]:
    """Per depth N (1 to the layers - 1): (tokens of ``new`` [1, m] the first N layers predict from plain's own
    prefix, m)."""
    full = torch.cat([ids, new], dim=1)
    out = model(full, output_hidden_states=True)
    base = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    m = new.shape[1]
    found = {}
    for n in range(1, int(model.config.num_hidden_layers)):
        hidden = out.hidden_states[n][:, ids.shape[1] - 1: -1]  # [1, m, H] after layer n, before each new token
        predicted = head(base.norm(hidden)).argmax(-1)  # [1, m]
        found[n] = (int((predicted == new).sum()), m)
    return found


def best(cost: float, acceptance: float, longest: int = 12):
    """``costmodel.best_round`` in plain steps: a draft step ``cost``, t(n) flat up to ``longest + 1`` inputs."""
    from hf_specdec.costmodel import ForwardCost, RoundCost, best_round, prefix_gains

    flat = ForwardCost.from_table({n: 1.0 for n in range(1, longest + 2)})
    return best_round(RoundCost(flat, t_draft=cost), prefix_gains([acceptance] * longest))


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    model, tokenizer, info = load(args)
    prompts = load_prompts(tokenizer, args.limit)
    hf_specdec.enable(model)
    greedy = dict(max_new_tokens=args.new, do_sample=False)
    fixed = hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=4, history_lookup=False)
    record = {"model": info, "layers": args.layers, "new_tokens": args.new, "prompts": [p for p, _ in prompts],
              "costs": costs(model, prompts[0][1], args.layers, args.steps), "runs": []}
    print(json.dumps(record["costs"], indent=1), flush=True)
    type(model).generate(model, prompts[0][1][:, :16], max_new_tokens=4, do_sample=False)  # warm-up
    modes = (("fixed4", {"spec_config": fixed, "speculative_memory": None}),) if args.fixed else ()
    modes += (("adaptive", {}),)
    for prompt_id, ids in prompts:
        reference, seconds = timed(lambda: type(model).generate(model, ids, **greedy))
        agreed = agreement(model, ids, reference[:, ids.shape[1]:])
        rows = [{"prompt": prompt_id, "mode": "plain", "seconds": seconds, "new": reference.shape[1] - ids.shape[1],
                 "agreement": agreed}]
        for n in args.layers:
            for mode, extra in modes:
                out, seconds = timed(lambda: model.generate(ids, assistant_early_exit=n, **greedy, **extra))
                stats = model.last_spec_stats.get()
                rows.append({"prompt": prompt_id, "mode": f"{mode}_N{n}", "layers": n, "seconds": seconds,
                             "new": out.shape[1] - ids.shape[1], "identical": bool(torch.equal(out, reference)),
                             "drafted": stats.drafted - stats.lookup_drafted,
                             "accepted": stats.accepted - stats.lookup_accepted,
                             "lookup_drafted": stats.lookup_drafted, "lookup_accepted": stats.lookup_accepted,
                             "first_position": (stats.accepted_per_position[0], stats.drafted_per_position[0])
                             if stats.drafted_per_position else (0, 0),
                             "tokens_per_forward": stats.mean_accepted_length, "rounds_spec_off": stats.rounds_spec_off,
                             "rounds": stats.rounds, "draft_setup_s": stats.draft_setup_time_s,
                             "draft_s": stats.draft_time_s, "draft_cache_bytes": stats.draft_cache_bytes})
        for row in rows:
            print(json.dumps(row), flush=True)
        record["runs"].extend(rows)
    return record


def table(record: dict) -> str:
    runs = record["runs"]
    total = {}
    for row in runs:
        seconds, new = total.get(row["mode"], (0.0, 0))
        total[row["mode"]] = (seconds + row["seconds"], new + row["new"])
    plain_rate = total["plain"][1] / total["plain"][0]
    plain = [r for r in runs if r["mode"] == "plain"]
    lines = [f"plain: {plain_rate:.2f} tok/s over {len(record['prompts'])} prompts x {record['new_tokens']} tokens",
             "", "| N | c (narrow head) | c (full head) | greedy acceptance (per prompt) | best round: k, speedup | "
             "adaptive vs plain | adaptive: kept / judged draft tokens | fixed k=4 vs plain | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in record["layers"]:
        agreed = [r["agreement"].get(n) or r["agreement"].get(str(n)) for r in plain]
        acceptance = sum(a for a, _ in agreed) / max(1, sum(m for _, m in agreed))
        cost = record["costs"][n] if n in record["costs"] else record["costs"][str(n)]
        round_ = best(cost["c"], acceptance)
        mine = [r for r in runs if r.get("layers") == n]
        rate = {m: total[f"{m}_N{n}"][1] / total[f"{m}_N{n}"][0] / plain_rate if f"{m}_N{n}" in total else None
                for m in ("fixed4", "adaptive")}
        adaptive = [r for r in mine if r["mode"] == f"adaptive_N{n}"]
        kept = f"{sum(r['accepted'] for r in adaptive)} / {sum(r['drafted'] for r in adaptive)}"
        fixed = "-" if rate["fixed4"] is None else f"{rate['fixed4']:.2f}x"
        per_prompt = ", ".join(f"{a / m:.2f}" for a, m in agreed)
        lines.append(f"| {n} | {cost['c']:.3f} | {cost['c_full']:.3f} | {acceptance:.2f} ({per_prompt}) | "
                     f"{round_.k}, {round_.rate:.2f}x | {rate['adaptive']:.2f}x | {kept} | {fixed} | "
                     f"{all(r['identical'] for r in mine)} |")
    depths = sorted({int(n) for r in plain for n in r["agreement"]})
    by_depth = []
    for n in depths:
        agreed = [r["agreement"].get(n) or r["agreement"].get(str(n)) for r in plain]
        by_depth.append(f"{n}: {sum(a for a, _ in agreed) / max(1, sum(m for _, m in agreed)):.2f}")
    lines += ["", "greedy acceptance by depth (all prompts): " + ", ".join(by_depth)]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=lambda text: [int(x) for x in text.split(",")], default=None,
                        help="comma-separated N (default 4,8,12; 2,4 of the tiny model's 6 with --tiny)")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--fixed", action="store_true", help="also the fixed policy, 4 draft tokens a round")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.layers is None:
        args.layers = [2, 4] if args.tiny else [4, 8, 12]
    record = run(args)
    import transformers

    record["machine"] = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "threads": args.threads}
    text = table(record)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "early_exit.json").write_text(json.dumps(record, indent=1, default=str))
        (out / "early_exit.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
