"""`ptbr test-gpu`: probe the accelerator, then one real forward + backward + step of a preset."""

from __future__ import annotations

import time

from ptbr.commands import check_preset_request, quiet_transformers
from ptbr.errors import DeviceError, PtbrError
from ptbr.files import first_line

SMALLER_PROBE = "give a smaller --model-size (85m, tiny) or --batch-size"

DEVICE_NAMES = {"cpu": "the CPU", "cuda": "the GPU", "mps": "Apple MPS"}
# what the peak memory the probe prints is, per device type
PEAK_OF = {"cuda": "the allocator's peak since the probe began",
           "cpu": "the process's peak resident memory, interpreter and libraries included"}


def probe_accelerator() -> dict:
    """What torch sees; never raises (a diagnostic must not crash itself)."""
    facts: dict = {}
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["cuda_available"] = torch.cuda.is_available()
        facts["cuda_build"] = torch.version.cuda
        facts["gpus"] = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
            facts["gpus"].append({
                "index": index, "name": props.name, "memory_total": total, "memory_free": free,
                "compute_capability": f"{props.major}.{props.minor}",
            })
        if facts["cuda_available"]:
            facts["real_bf16"] = torch.cuda.is_bf16_supported(including_emulation=False)
            facts["fp16"] = True
        mps = getattr(torch.backends, "mps", None)
        facts["mps_available"] = bool(mps and mps.is_available())
    except Exception as exc:  # noqa: BLE001
        facts["error"] = f"{type(exc).__name__}: {exc}"
    return facts


def refuse_a_probe_beyond_ram(model_size: str, batch_size: int, seq_len: int, vocab_size: int,
                              precision: str) -> None:
    """On a CPU, a probe whose step needs more than the memory free (RAM and swap, or what a
    container's limit leaves) is refused (exit 5): the kernel would kill it, with no line."""
    from ptbr.config import PretrainConfig, get_preset
    from ptbr.memory import Architecture, estimate_training_memory
    from ptbr.ram import ram

    arch = Architecture.from_preset(get_preset(model_size), vocab_size)
    needed = estimate_training_memory(arch, batch_size, seq_len, precision, device="cpu",
                                      chunked_loss=PretrainConfig().chunked_loss).total  # as the probe runs
    memory = ram()
    free = memory.free_with_swap()
    if needed > free:
        raise DeviceError(f"the probe step of {model_size} (batch {batch_size} x {seq_len}, {precision}) needs about "
                          f"{needed / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB is free ({memory.where()}): the kernel "
                          "would kill it", "ptbr test-gpu", SMALLER_PROBE)


def run_probe_step(model_size: str, batch_size: int, seq_len: int, vocab_size: int, placement) -> dict:
    import numpy as np
    import torch

    from ptbr.backends.torch.models import build_model, count_parameters
    from ptbr.backends.torch.step import TorchStep, build_optimizer
    from ptbr.config import PretrainConfig, get_preset
    from ptbr.data.batch import windows_to_batch

    preset = get_preset(model_size)
    if placement.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(placement.device)
    started = time.monotonic()
    model = build_model(preset, vocab_size, eos_id=0, seed=0).to(placement.device)
    settings = PretrainConfig()
    backend = TorchStep(model, build_optimizer(model, settings, placement.device), placement, 1.0,
                        chunked_loss=settings.chunked_loss)
    windows = np.random.default_rng(0).integers(0, vocab_size, size=(batch_size, seq_len + 1))
    build_s = time.monotonic() - started
    started = time.monotonic()
    result = backend.train_step([windows_to_batch(windows)], lr=1e-4)
    if placement.device.type == "cuda":
        torch.cuda.synchronize(placement.device)
    return {
        "device": str(placement.device), "precision": placement.precision, "reason": placement.reason,
        "model_size": model_size, "parameters": count_parameters(model), "batch_size": batch_size,
        "seq_len": seq_len, "loss": result.loss, "grad_norm": result.grad_norm,
        "build_s": round(build_s, 2), "step_s": round(time.monotonic() - started, 2),
        # the probe's peak (ptbr.backends.torch.device.peak_memory), never the memory in use after the step
        "peak_memory_bytes": backend.memory_bytes(), "peak_memory_of": PEAK_OF.get(placement.device.type, PEAK_OF["cpu"]),
    }


def main(args) -> int:
    check_preset_request("test-gpu", args.model_size, args.seq_len, batch_size=args.batch_size,
                         vocab_size=args.vocab_size)
    quiet_transformers()
    from ptbr.backends.torch.device import resolve_device, resolve_precision

    facts = probe_accelerator()
    # resolved before anything is printed: `--device cuda` without a GPU is one error line (exit 5)
    placement = resolve_precision(resolve_device(args.device), args.precision)
    running_on = f"running the probe on {DEVICE_NAMES.get(placement.device.type, placement.device.type)}"
    print(f"torch {facts.get('torch')} (CUDA build {facts.get('cuda_build')})")
    if facts.get("gpus"):
        for gpu in facts["gpus"]:
            print(f"GPU {gpu['index']}: {gpu['name']}, compute {gpu['compute_capability']}, "
                  f"{gpu['memory_free'] / 1024**3:.1f} of {gpu['memory_total'] / 1024**3:.1f} GiB free")
        print(f"real bf16: {facts.get('real_bf16')} (T4-class GPUs: no -> fp16 + GradScaler)")
        print(running_on)
    else:
        print("no CUDA GPU found" + (" (Apple MPS is available)" if facts.get("mps_available") else "")
              + f": {running_on}")
    if placement.device.type == "cpu":
        from ptbr.backends.torch.device import fit_threads_to_cpus

        said = fit_threads_to_cpus()
        if said:
            print(said)
        refuse_a_probe_beyond_ram(args.model_size, args.batch_size, args.seq_len, args.vocab_size, placement.precision)
    try:
        r = run_probe_step(args.model_size, args.batch_size, args.seq_len, args.vocab_size, placement)
    except Exception as exc:
        from ptbr.backends.torch import is_out_of_memory

        if isinstance(exc, PtbrError) or not is_out_of_memory(exc):
            raise
        raise DeviceError(f"out of memory on {placement.device} in the probe step of {args.model_size} (batch "
                          f"{args.batch_size} x {args.seq_len}): {first_line(exc)[:160]}", "ptbr test-gpu",
                          SMALLER_PROBE) from exc
    print(f"one training step of {r['model_size']} ({r['parameters']:,} parameters) on {r['device']} in "
          f"{r['precision']}: batch {r['batch_size']} x {r['seq_len']}, loss {r['loss']:.4f}, "
          f"step {r['step_s']} s, peak memory {r['peak_memory_bytes'] / 1024**3:.2f} GiB ({r['peak_memory_of']})")
    return 0
