"""fp32 Linear layers as transformers runs them against the same weights reordered once by oneDNN
(``hf_specdec.models.packed``): one layer by input rows, then a real model's t(n), dense against packed.

    python bench/packed.py                                    # one 1536 -> 8960 layer, then the bundled 1.5B target
    python bench/packed.py --model qwen2.5-coder-0.5b-instruct --sizes 1,2,4,8
    python bench/packed.py --layer-only                       # the layer alone (seconds)
    python bench/packed.py --tiny --json /tmp/packed.json     # smoke run: a tiny random model (seconds)

t(n): one forward over n new tokens on top of a cached 100-token context (``costmodel.forward_times``, the
hardware profile's own timing, median of ``--repeats``), logits at the n positions. Also checks that 24
greedy tokens of the packed model equal the dense model's. Prints one markdown table per part; the CPU, torch
and thread count on top (state them beside every figure, docs/benchmarks.md). ``--json`` also writes the model
part's record: its greedy tokens and whether the packed model's equal the dense model's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_specdec.costmodel import forward_times  # noqa: E402
from hf_specdec.models.packed import PackedLinear, pack_linears  # noqa: E402


def layer_table(in_features: int, out_features: int, sizes, repeats: int) -> str:
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=False).eval()
    packed = PackedLinear(linear)
    rows = {"F.linear": linear, "packed": packed}
    lines = [f"one Linear {in_features} -> {out_features}, fp32, ms by input rows (median of {repeats})", "",
             "| layer | " + " | ".join(str(n) for n in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for name, layer in rows.items():
        cells = []
        for n in sizes:
            x = torch.randn(n, in_features)
            with torch.no_grad():
                for _ in range(3):
                    layer(x)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    layer(x)
                    times.append(time.perf_counter() - start)
            cells.append(f"{sorted(times)[len(times) // 2] * 1e3:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def model_table(ref: str, sizes, repeats: int, tiny: bool = False) -> tuple[str, dict]:
    """The model part's table and its record (``identical_to_dense``: the packed model's 24 greedy tokens are the
    dense model's). ``tiny``: ``tiny_pair()``'s target instead of ``ref``."""
    if tiny:
        from hf_specdec.models.tiny import tiny_pair

        model, _, tokenizer = tiny_pair(seed=0)
        ref = "tiny"
    else:
        from hf_specdec.models import load_model

        model, tokenizer, _ = load_model(ref, dtype="fp32")
    prefix = torch.randint(min(100, len(tokenizer) // 2), min(5000, len(tokenizer)), (1, 100))
    prompt = tokenizer("def fibonacci(n):\n", return_tensors="pt")
    with torch.no_grad():
        dense_out = type(model).generate(model, **prompt, max_new_tokens=24, do_sample=False)
    dense = forward_times(model, prefix, sizes, repeats)
    start = time.perf_counter()
    pack_linears(model)
    pack_s = time.perf_counter() - start
    packed = forward_times(model, prefix, sizes, repeats)
    with torch.no_grad():
        packed_out = type(model).generate(model, **prompt, max_new_tokens=24, do_sample=False)
        same = torch.equal(packed_out, dense_out)
    new = prompt["input_ids"].shape[1]
    record = {"model": ref, "dense": dense_out[0, new:].tolist(), "packed": packed_out[0, new:].tolist(),
              "identical_to_dense": same}
    lines = [f"{ref}: t(n) ms over a 100-token context (median of {repeats}); packing took {pack_s:.1f} s; "
             f"24 greedy tokens identical to the dense model's: {same}", "",
             "| format | " + " | ".join(str(n) for n in sizes) + " | t(8) / t(1) |",
             "|---|" + "---|" * (len(sizes) + 1)]
    for name, table in (("fp32 (F.linear)", dense), ("fp32-packed", packed)):
        ratio = f"{table[8] / table[1]:.2f}" if 8 in table else "–"
        lines.append(f"| {name} | " + " | ".join(f"{table[n] * 1e3:.0f}" for n in sizes) + f" | {ratio} |")
    return "\n".join(lines), record


def main(argv=None) -> int:
    from hf_specdec.models import DEFAULT_TARGET
    from hf_specdec.models.hardware import machine_record

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--sizes", default="1,2,3,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layer", default="1536,8960", help="in,out features of the one-layer part")
    parser.add_argument("--layer-only", action="store_true")
    parser.add_argument("--tiny", action="store_true",
                        help="smoke run: a 64 -> 256 layer and tiny_pair()'s target, sizes 1,2,4, one repeat")
    parser.add_argument("--json", default=None, help="write the machine and the model part's record here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.sizes, args.repeats, args.layer, args.layer_only = "1,2,4", 1, "64,256", False
    sizes = [int(n) for n in args.sizes.split(",")]
    machine = machine_record(dtype="float32")
    print(f"{machine['cpu_model']} ({', '.join(machine['cpu_flags']) or 'no listed flags'}), "
          f"{torch.get_num_threads()} threads, torch {machine['torch']}, transformers {machine['transformers']}\n")
    print(layer_table(*(int(v) for v in args.layer.split(",")), sizes, args.repeats * 6))
    record = None
    if not args.layer_only:
        print()
        table, record = model_table(args.model, sizes, args.repeats, tiny=args.tiny)
        print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "tiny": args.tiny, "model": record}, indent=1,
                                              default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
