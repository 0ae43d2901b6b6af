"""fp32 Linear layers as transformers runs them against the same weights reordered once by oneDNN
(``hf_specdec.models.packed``): one layer by input rows, then a real model's t(n), dense against packed.

    python bench/packed.py                                    # one 1536 -> 8960 layer, then the bundled 1.5B target
    python bench/packed.py --model qwen2.5-coder-0.5b-instruct --sizes 1,2,4,8
    python bench/packed.py --layer-only                       # the layer alone (seconds)

t(n): one forward over n new tokens on top of a cached 100-token context (``costmodel.forward_times``, the
hardware profile's own timing, median of ``--repeats``), logits at the n positions. Also checks that 24
greedy tokens of the packed model equal the dense model's. Prints one markdown table per part; the CPU, torch
and thread count on top (state them beside every figure, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
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


def model_table(ref: str, sizes, repeats: int) -> str:
    from hf_specdec.models import load_model

    model, tokenizer, _ = load_model(ref, dtype="fp32")
    prefix = torch.randint(100, 5000, (1, 100))
    prompt = tokenizer("def fibonacci(n):\n", return_tensors="pt")
    with torch.no_grad():
        dense_out = type(model).generate(model, **prompt, max_new_tokens=24, do_sample=False)
    dense = forward_times(model, prefix, sizes, repeats)
    start = time.perf_counter()
    pack_linears(model)
    pack_s = time.perf_counter() - start
    packed = forward_times(model, prefix, sizes, repeats)
    with torch.no_grad():
        same = torch.equal(type(model).generate(model, **prompt, max_new_tokens=24, do_sample=False), dense_out)
    lines = [f"{ref}: t(n) ms over a 100-token context (median of {repeats}); packing took {pack_s:.1f} s; "
             f"24 greedy tokens identical to the dense model's: {same}", "",
             "| format | " + " | ".join(str(n) for n in sizes) + " | t(8) / t(1) |",
             "|---|" + "---|" * (len(sizes) + 1)]
    for name, table in (("fp32 (F.linear)", dense), ("fp32-packed", packed)):
        ratio = f"{table[8] / table[1]:.2f}" if 8 in table else "–"
        lines.append(f"| {name} | " + " | ".join(f"{table[n] * 1e3:.0f}" for n in sizes) + f" | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from hf_specdec.models import DEFAULT_TARGET
    from hf_specdec.models.hardware import machine_record

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--sizes", default="1,2,3,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layer", default="1536,8960", help="in,out features of the one-layer part")
    parser.add_argument("--layer-only", action="store_true")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")]
    machine = machine_record(dtype="float32")
    print(f"{machine['cpu_model']} ({', '.join(machine['cpu_flags']) or 'no listed flags'}), "
          f"{torch.get_num_threads()} threads, torch {machine['torch']}, transformers {machine['transformers']}\n")
    print(layer_table(*(int(v) for v in args.layer.split(",")), sizes, args.repeats * 6))
    if not args.layer_only:
        print()
        print(model_table(args.model, sizes, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
