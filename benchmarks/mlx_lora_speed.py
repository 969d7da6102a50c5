"""Is ptbr's MLX LoRA as fast as mlx-lm's own trainer? Tokens per second of `ptbr finetune --backend
mlx` against `mlx_lm.lora` on the same model, data and batch (a benchmark, not a test).

    python benchmarks/mlx_lora_speed.py                 # Metal on Apple Silicon, else mlx[cpu]
    python benchmarks/mlx_lora_speed.py --steps 30 --batch-size 8 --hidden 1024 --layers 8

The base is a Mistral-shaped model (grouped-query attention, SwiGLU) with random weights and the
bundled PT-BR tokenizer, saved as a Hugging Face folder; the data are plain-text examples cut from
the bundled PT-BR sample. Both trainers run LoRA of the same rank and scale on every projection of
every layer, no dropout, the same batch size and learning rate, for the same number of steps;
the first steps (compilation) are not timed. mlx-lm batches examples of similar length together
(sorted by length): ptbr runs with --group-by-length, its own way of doing so. Both are timed from
the end of the last untimed step to the end of the last, the making of each batch included: ptbr
by metrics.jsonl's elapsed_s (the loop's wall clock at each row), mlx-lm by the wall clock at its step reports.
Tokens are the tokens a loss is taken on (the ones both count the same way: every token of an
example but its first).

Each run is a fresh process (nothing compiled, cached or allocated by one trainer helps the other),
the two take turns and swap who goes first every repeat; each side's value is its median run, the
ratio is that of the two medians, and the ratio within each repeat is kept beside it (its spread).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

WARMUP = 3  # steps left out of the timing: the first compiles, the next settle the allocator


def make_base(directory: Path, hidden: int, layers: int, dtype: str) -> None:
    """A random Mistral-shaped model and the bundled tokenizer, as a Hugging Face folder."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    from ptbr.data import SAMPLE_DIR
    from ptbr.data.tokenizer import load_tokenizer, save_for_transformers

    vocab = load_tokenizer(SAMPLE_DIR / "tokenizer.json").get_vocab_size()
    config = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": vocab,
              "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": hidden // 64,
              "num_key_value_heads": max(1, hidden // 256), "intermediate_size": int(3.5 * hidden),
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 0, "pad_token_id": 1}
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_for_transformers(SAMPLE_DIR / "tokenizer.json", directory)


def make_data(directory: Path, examples: int, words: int) -> None:
    from ptbr.data import SAMPLE_DIR

    text = (SAMPLE_DIR / "sample_ptbr.txt").read_text(encoding="utf-8").split()
    rows = [" ".join(text[(i * words) % (len(text) - words):][:words]) for i in range(examples)]
    # no validation set: neither trainer evaluates, so the timed steps are steps alone
    with open(directory / "train.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": row}, ensure_ascii=False) + "\n" for row in rows)


def ptbr_speed(base: Path, data: Path, output: Path, args) -> dict:
    """ptbr's own pipeline (run_finetune: checks, chat/text encoding, buckets, the MlxStep)."""
    from ptbr.config import FinetuneConfig
    from ptbr.data.batch import target_count
    from ptbr.runs.finetune import run_finetune

    settings = FinetuneConfig(backend="mlx", base=str(base), data=str(data), output=str(output), quant="none",
                              lora_r=args.rank, lora_alpha=args.rank * args.scale, lora_dropout=0.0,
                              batch_size=args.batch_size, max_steps=args.steps, learning_rate=1e-4, eval_every=0,
                              save_every=args.steps, max_seq_len=args.max_seq_len, precision="auto",
                              group_by_length=True)  # mlx-lm sorts its examples by length into batches
    result = run_finetune(settings)
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    seconds = rows[-1]["elapsed_s"] - rows[WARMUP - 1]["elapsed_s"]  # steps WARMUP+1 .. steps
    tokens = sum(target_count(b) for step in range(WARMUP, args.steps) for b in result.source.cycle(step))
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "peak_memory_gb": rows[-1]["mem_bytes"] / 1e9}


def mlx_lm_speed(base: Path, data: Path, output: Path, args) -> dict:
    """mlx-lm's trainer (what `mlx_lm.lora --train` runs), timed by the wall clock at its step reports."""
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.datasets import CacheDataset, load_dataset
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    model, tokenizer = load(str(base))
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": args.rank, "scale": args.scale, "dropout": 0.0})
    dataset_args = argparse.Namespace(data=str(data), train=True, test=False, hf_dataset=None, mask_prompt=False)
    train_set, _, _ = load_dataset(dataset_args, tokenizer)

    class Reports(TrainingCallback):
        def __init__(self):
            self.reports = []

        def on_train_loss_report(self, info):  # every step (steps_per_report=1), as it ends
            self.reports.append(info | {"wall_s": time.perf_counter()})

    reports = Reports()
    training = TrainingArgs(batch_size=args.batch_size, iters=args.steps, val_batches=1, steps_per_report=1,
                            steps_per_eval=10**9, steps_per_save=10**9, max_seq_length=args.max_seq_len,
                            adapter_file=str(output / "adapters.safetensors"))
    train(model, optim.Adam(learning_rate=1e-4), CacheDataset(train_set), None, args=training,
          training_callback=reports)
    # wall-clock from the end of step WARMUP to the end of the last, as ptbr's side is timed: its own
    # it/s leaves out the time between steps (making and padding the next batch)
    start, end = reports.reports[WARMUP - 1], reports.reports[-1]
    tokens = end["trained_tokens"] - start["trained_tokens"]
    seconds = end["wall_s"] - start["wall_s"]
    return {"tokens": round(tokens), "seconds": seconds, "tokens_per_s": tokens / seconds,
            "peak_memory_gb": mx.get_peak_memory() / 1e9}


SPEEDS = {"ptbr": ptbr_speed, "mlx_lm": mlx_lm_speed}


def cpu_model() -> str:
    """The CPU's model name where the system says it (Linux), else its architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--words", type=int, default=60, help="words per example (~ 1.5 tokens each)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each trainer, alternating; each side's median run counts (shared machines)")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--scale", type=float, default=2.0)
    parser.add_argument("--dtype", default=None, help="base weights (default: bfloat16 on Metal, float32 on CPU)")
    parser.add_argument("--json", help="also write the result to this file (mlx-lm's progress shares stdout)")
    parser.add_argument("--worker", nargs=3, metavar=("TRAINER", "ROOT", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    import mlx.core as mx
    import mlx_lm

    from ptbr.log import setup_console

    setup_console(40)
    if args.worker:  # one timed run, in this fresh process: its result as JSON in RESULT
        name, root, result = args.worker
        output = Path(root) / f"{name}-{Path(result).stem}"
        output.mkdir()
        measured = SPEEDS[name](Path(root) / "base", Path(root) / "data", output, args)
        Path(result).write_text(json.dumps(measured))
        return
    metal = mx.metal.is_available()
    dtype = args.dtype or ("bfloat16" if metal else "float32")
    worker_args = [f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items()
                   if key not in ("json", "worker", "dtype")]
    with tempfile.TemporaryDirectory(prefix="ptbr-mlx-speed-") as tmp:
        root = Path(tmp)
        for name in ("base", "data"):
            (root / name).mkdir()
        make_base(root / "base", args.hidden, args.layers, dtype)
        make_data(root / "data", args.batch_size * args.steps, args.words)
        runs = {"ptbr": [], "mlx_lm": []}
        for repeat in range(args.repeats):
            for name in (("ptbr", "mlx_lm") if repeat % 2 == 0 else ("mlx_lm", "ptbr")):
                result = root / f"run{repeat}.{name}.json"
                subprocess.run([sys.executable, __file__, *worker_args, f"--dtype={dtype}",
                                "--worker", name, str(root), str(result)], check=True, stdout=subprocess.DEVNULL)
                runs[name].append(json.loads(result.read_text()))
    speeds = {name: [r["tokens_per_s"] for r in found] for name, found in runs.items()}
    ours, theirs = statistics.median(speeds["ptbr"]), statistics.median(speeds["mlx_lm"])
    device = f"Metal ({mx.device_info().get('device_name', 'GPU')})" if metal else f"mlx[cpu] ({cpu_model()})"
    command = " ".join(["python benchmarks/mlx_lora_speed.py", *sys.argv[1:]])
    result = {"device": device, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "dtype": dtype,
              "settings": vars(args) | {"worker": None},
              "method": "a fresh process per run, the trainers alternating (who goes first swaps every repeat); "
                        "tokens/s: each side's median run",
              "ptbr": {"tokens_per_s": ours, "peak_memory_gb": max(r["peak_memory_gb"] for r in runs["ptbr"])},
              "mlx_lm_lora": {"tokens_per_s": theirs,
                              "peak_memory_gb": max(r["peak_memory_gb"] for r in runs["mlx_lm"])},
              "every_run_tokens_per_s": {k: [round(v, 1) for v in found] for k, found in speeds.items()},
              "ratio": ours / theirs,
              "round_ratios": [o / t for o, t in zip(speeds["ptbr"], speeds["mlx_lm"], strict=True)],
              "command": command}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
