"""`ptbr smoke`: one optimizer step of `tiny` at seq_len 64 on the bundled sample, save, reload
(--backend torch or mlx; with mlx neither the run nor the checks import torch)."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

from ptbr.commands import quiet_transformers
from ptbr.errors import Interrupted, PtbrError, SmokeFailed
from ptbr.files import first_line, is_litter
from ptbr.log import log

# Marks a directory as smoke's own, so that `ptbr smoke --output DIR` never writes into someone's run.
SMOKE_MARKER = ".ptbr-smoke"


def run_smoke(output: Path, device: str = "auto", backend: str = "auto") -> dict:
    from ptbr.config import PretrainConfig
    from ptbr.runs.common import create_run_dir
    from ptbr.runs.pretrain import run_pretrain

    if output.is_dir() and any(not is_litter(p) for p in output.iterdir()) and not (output / SMOKE_MARKER).is_file():
        raise SmokeFailed("smoke failed: --output already holds other files (a run, a dataset?); smoke writes a "
                          "run of its own there", str(output), "give a new or empty directory")
    create_run_dir(str(output))
    (output / SMOKE_MARKER).write_text("a `ptbr smoke` run: a later smoke may replace it\n")
    settings = PretrainConfig(output=str(output), model_size="tiny", seq_len=64, batch_size=4, max_steps=1,
                              save_every=1, eval_every=1, eval_batches=2, device=device, backend=backend,
                              resume="never")
    summary = run_pretrain(settings, report=False)  # a check: no report.md, no "no report" line
    loss = summary["final_loss"]
    if loss is None or not math.isfinite(loss):
        raise SmokeFailed(f"smoke failed: the training loss is not finite: {loss}", str(output),
                          "run `ptbr test-gpu` and report it")
    # the checkpoint must reload into a fresh model with bit-identical weights, and final/ must load
    # and compute finite logits: in plain transformers (torch), in plain mlx-lm (MLX)
    check = _check_mlx if summary["backend"] == "mlx" else _check_torch
    tensors, loads_in = check(output)
    return {"loss": loss, "tensors": tensors, "output": str(output), "backend": summary["backend"],
            "loads_in": loads_in}


def _check_torch(output: Path) -> tuple[int, str]:
    import torch
    from transformers import AutoModelForCausalLM

    from ptbr.train.checkpoint import checkpoint_path

    checkpoint = checkpoint_path(output, 1)
    from_checkpoint = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    final = AutoModelForCausalLM.from_pretrained(str(output / "final"))
    a, b = from_checkpoint.state_dict(), final.state_dict()
    mismatched = [name for name in a if not torch.equal(a[name], b[name])]
    if mismatched or a.keys() != b.keys():
        raise SmokeFailed(f"smoke failed: the reloaded checkpoint differs from the final model in {mismatched[:3]}",
                          str(checkpoint), "check the disk and report it")
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        logits = final(input_ids=ids).logits
    if not torch.isfinite(logits).all():
        raise SmokeFailed("smoke failed: the reloaded model computes non-finite logits", str(output / "final"),
                          "report it")
    return len(a), "transformers"


def _check_mlx(output: Path) -> tuple[int, str]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ptbr.backends.mlx.file_limit import load_mlx_lm

    load_mlx_lm()  # first: keeps the open-file limit (file_limit.py)
    from mlx_lm.utils import load_model

    from ptbr.train.checkpoint import checkpoint_path

    checkpoint = checkpoint_path(output, 1)
    a = dict(tree_flatten(load_model(checkpoint)[0].parameters()))
    final = load_model(output / "final")[0]
    b = dict(tree_flatten(final.parameters()))
    mismatched = [name for name in a if name not in b or not mx.array_equal(a[name], b[name]).item()]
    if mismatched or a.keys() != b.keys():
        raise SmokeFailed(f"smoke failed: the reloaded checkpoint differs from the final model in {mismatched[:3]}",
                          str(checkpoint), "check the disk and report it")
    logits = final(mx.arange(1, 17)[None])
    if not mx.all(mx.isfinite(logits)).item():
        raise SmokeFailed("smoke failed: the reloaded model computes non-finite logits", str(output / "final"),
                          "report it")
    return len(a), "mlx-lm"


def _temporary_directory() -> tempfile.TemporaryDirectory:
    """Where smoke's run goes without --output; none writable is this machine's to fix, not a bug."""
    try:
        return tempfile.TemporaryDirectory(prefix="ptbr-smoke-")
    except OSError as exc:  # FileNotFoundError: "No usable temporary directory found in [...]"
        raise SmokeFailed(f"smoke failed: no writable temporary directory: {first_line(exc)}",
                          os.environ.get("TMPDIR", "TMPDIR unset"),
                          "set TMPDIR to a writable directory, or give --output DIR") from exc


def main(args) -> int:
    quiet_transformers()
    try:
        if args.output:
            result = run_smoke(Path(args.output), backend=args.backend)
            kept = f"; the run is in {args.output}"
        else:
            with _temporary_directory() as tmp:
                log(f"smoke: running in a temporary directory, removed at the end: {tmp}")
                try:
                    result = run_smoke(Path(tmp), backend=args.backend)
                except Interrupted as exc:  # its checkpoint goes with the temporary directory: nothing resumes
                    raise Interrupted(f"{exc.what}, and the temporary run directory was removed with its "
                                      "checkpoint", "ptbr smoke", "run `ptbr smoke` again") from exc
            kept = "; the temporary run directory was removed (--output DIR keeps a run)"
    except (SmokeFailed, Interrupted):
        raise
    except PtbrError as exc:  # whatever broke, `ptbr smoke` failed (exit 9), and the line says why
        raise SmokeFailed(f"smoke failed: {exc.what}", exc.where, exc.fix) from exc
    except Exception as exc:  # noqa: BLE001 - a crash inside the smoke run is what the smoke test is for
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise SmokeFailed(f"smoke failed: unexpected {type(exc).__name__}: {first}", args.output,
                          "rerun with --debug for the traceback, and report it") from exc
    print(f"smoke ok: one step of tiny, loss {result['loss']:.4f} on {result['backend']}, checkpoint reloaded "
          f"identically ({result['tensors']} tensors), final/ loads in {result['loads_in']}{kept}")
    return 0
