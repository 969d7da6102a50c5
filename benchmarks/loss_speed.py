"""The training loss alone: ptbr's chunked loss against the whole logits (a benchmark, not a test).

    python benchmarks/loss_speed.py --device cuda          # the presets' GPU shapes at a 32k vocabulary
    python benchmarks/loss_speed.py --device cpu           # smaller CPU shapes
    python benchmarks/loss_speed.py --quick                # tiny shapes: checks that it runs (CI)

For each shape: the output layer's multiply and the summed cross-entropy, forward and backward, on
random final hidden states (fp32, as the model's final norm gives them) and a random output layer
(trained: its gradient is made too), in the run's precision (bf16 autocast on a GPU, as ptbr
pretrains there). The whole logits are what transformers' models and ptbr's --no-chunked-loss
compute (the logits upcast to fp32, F.cross_entropy); the chunked loss is
ptbr.backends.torch.loss.chunked_cross_entropy at the chunk ptbr takes on that device, and at
larger chunks, to show what the chunk size trades. Each value is the median time of the timed
repeats (CUDA events on a GPU, the wall clock on CPU) and, on a GPU, the peak memory allocated
above the inputs and one set of their gradients. Every variant's loss and both gradients are checked against the whole logits'
before it is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

# (name, tokens, hidden size) at a 32k vocabulary: the presets' pretraining batches on a GPU (as
# benchmarks/speed.py runs them), smaller ones on CPU
SHAPES = {
    "cuda": [("85m, 16 x 1024", 16384, 640), ("400m, 8 x 1024", 8192, 1024), ("800m, 4 x 2048", 8192, 1536),
             ("85m, 2 x 1024", 2048, 640)],
    "cpu": [("85m, 8 x 256", 2048, 640), ("tiny, 8 x 256", 2048, 128)],
}
QUICK = [("quick, 2 x 64", 128, 32)]
LARGER_CHUNKS = (4096, 8192)  # also timed where a shape has more tokens
QUICK_CHUNKS = (48,)  # three chunks of the quick shape's 128 tokens


def measure(fn, device: str, warmup: int, repeats: int) -> tuple[float, float | None]:
    """Median milliseconds of `fn` and, on a GPU, its peak MiB allocated above what was allocated
    before it: the inputs and the gradients of the run before (which `fn` drops first), so that the
    peak is what the loss holds beyond the inputs and one set of their gradients."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    peak = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    return statistics.median(times), peak


def shape_rows(name: str, tokens: int, hidden: int, vocab: int, device: str, precision: str,
               warmup: int, repeats: int, chunks: tuple[int, ...] = LARGER_CHUNKS) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from ptbr.backends.torch.loss import chunk_size, chunked_cross_entropy
    from ptbr.data.batch import IGNORE_INDEX

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    generator = torch.Generator(device=device).manual_seed(0)
    hidden_states = torch.randn(tokens, hidden, device=device, generator=generator, requires_grad=True)
    weight = (0.02 * torch.randn(vocab, hidden, device=device, generator=generator)).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=generator)

    def clear():
        hidden_states.grad = weight.grad = None

    def whole():
        clear()
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            logits = F.linear(hidden_states, weight)
        loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        loss.backward()
        return loss.detach()

    def chunked(chunk: int):
        def run():
            clear()
            loss = chunked_cross_entropy(hidden_states, weight, labels, dtype, chunk)
            loss.backward()
            return loss.detach()
        return run

    default = chunk_size(weight, dtype, device)
    variants = {"whole logits": whole, f"chunked, {default:,} tokens (ptbr's)": chunked(default)}
    for chunk in chunks:
        if chunk != default and chunk <= tokens:
            variants[f"chunked, {chunk:,} tokens"] = chunked(chunk)
    reference = [whole().item(), hidden_states.grad.clone(), weight.grad.clone()]
    # the same sums in another order (and the output layer's gradient summed in fp32 from 16-bit
    # products per chunk, where the whole logits make one 16-bit product): relative to the largest
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    rows = []
    for label, fn in variants.items():
        loss = fn().item()
        # 16-bit logits may round differently where the multiplies' shapes differ (a chunk's against
        # the whole): a rare last-bit difference, far below a wrong loss's
        if abs(loss - reference[0]) > (1e-5 if dtype == torch.float32 else 1e-4) * abs(reference[0]):
            raise SystemExit(f"{name}, {label}: loss {loss} against the whole logits' {reference[0]}")
        for what, got, expected in (("hidden states'", hidden_states.grad, reference[1]),
                                    ("output layer's", weight.grad, reference[2])):
            off = (got - expected).abs().max().item()
            if off > tolerance * expected.abs().max().item():
                raise SystemExit(f"{name}, {label}: the {what} gradient is {off:.3g} off the whole logits'")
        ms, mib = measure(fn, device, warmup, repeats)
        rows.append({"shape": name, "tokens": tokens, "hidden": hidden, "vocab": vocab, "precision": precision,
                     "variant": label, "ms": ms, "peak_mib": mib})
        print(f"  {name}: {label}: {ms:.2f} ms" + (f", {mib:,.0f} MiB" if mib is not None else ""), flush=True)
    return rows


def markdown(rows: list[dict], machine: str) -> str:
    lines = [f"The loss alone on {machine}: forward and backward, median of the timed repeats.", "",
             "| shape | tokens | hidden | precision | loss | ms | x whole logits' time | peak MiB above the inputs "
             "and their gradients |",
             "|---|---:|---:|---|---|---:|---:|---:|"]
    whole = {r["shape"]: r["ms"] for r in rows if r["variant"] == "whole logits"}
    for r in rows:
        peak = f"{r['peak_mib']:,.0f}" if r["peak_mib"] is not None else "-"
        lines.append(f"| {r['shape']} | {r['tokens']:,} | {r['hidden']:,} | {r['precision']} | {r['variant']} | "
                     f"{r['ms']:.2f} | {r['ms'] / whole[r['shape']]:.2f} | {peak} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="default: bf16 on a GPU, fp32 on CPU")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="one tiny shape, two repeats: checks that it runs (CI)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here")
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    shapes, warmup, repeats, vocab, chunks = ((QUICK, 1, 2, 512, QUICK_CHUNKS) if args.quick else
                                              (SHAPES[args.device], 4, args.repeats, args.vocab, LARGER_CHUNKS))
    machine = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    machine += f", torch {torch.__version__}"
    rows = []
    for name, tokens, hidden in shapes:
        rows += shape_rows(name, tokens, hidden, vocab, args.device, precision, warmup, repeats, chunks)
    table = markdown(rows, machine)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
