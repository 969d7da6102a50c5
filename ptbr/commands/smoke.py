"""`ptbr smoke`: one optimizer step of `tiny` at seq_len 64 on the bundled sample, save, reload."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from ptbr.commands import quiet_transformers
from ptbr.errors import SmokeFailed


def run_smoke(output: Path, device: str = "auto") -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from ptbr.config import PretrainConfig
    from ptbr.runs.pretrain import run_pretrain
    from ptbr.train.checkpoint import checkpoint_path

    settings = PretrainConfig(output=str(output), model_size="tiny", seq_len=64, batch_size=4, max_steps=1,
                              save_every=1, eval_every=1, eval_batches=2, device=device, resume="never")
    summary = run_pretrain(settings)
    loss = summary["final_loss"]
    if loss is None or not math.isfinite(loss):
        raise SmokeFailed(f"the training loss is not finite: {loss}", str(output), "run `ptbr test-gpu` and report it")

    # the checkpoint must reload into a fresh model with bit-identical weights, and final/ must load
    # in plain transformers and compute the same logits
    checkpoint = checkpoint_path(output, 1)
    from_checkpoint = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    final = AutoModelForCausalLM.from_pretrained(str(output / "final"))
    a, b = from_checkpoint.state_dict(), final.state_dict()
    mismatched = [name for name in a if not torch.equal(a[name], b[name])]
    if mismatched or a.keys() != b.keys():
        raise SmokeFailed(f"the reloaded checkpoint differs from the final model in {mismatched[:3]}", str(checkpoint),
                          "check the disk and report it")
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        logits = final(input_ids=ids).logits
    if not torch.isfinite(logits).all():
        raise SmokeFailed("the reloaded model computes non-finite logits", str(output / "final"), "report it")
    return {"loss": loss, "tensors": len(a), "output": str(output)}


def main(args) -> int:
    quiet_transformers()
    if args.output:
        result = run_smoke(Path(args.output))
    else:
        with tempfile.TemporaryDirectory(prefix="ptbr-smoke-") as tmp:
            result = run_smoke(Path(tmp))
    print(f"smoke ok: one step of tiny, loss {result['loss']:.4f}, checkpoint reloaded identically "
          f"({result['tensors']} tensors), final/ loads in transformers")
    return 0
