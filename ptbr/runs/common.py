"""What every run does around the loop, pretraining or fine-tuning, on any backend.

- The run directory: created, locked against a second run, logged to train.log (errors included).
- Where to resume from, checked in one place before any model is built: the checkpoint must belong
  to this run (same mode, backend, model, data and batching, recorded in its trainer_state.json),
  be intact (every file's sha256), and not be past --max-steps. A run that starts over moves the
  previous run's files to OUTPUT/previous/, so no later --resume auto can pick them up.
- run_config.json and training_summary.json.
"""

from __future__ import annotations

import dataclasses
import errno
import shutil
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ptbr.backends.world import SingleProcess, World
from ptbr.config import default_warmup
from ptbr.cpus import processes_on_this_machine
from ptbr.errors import (
    EXIT_CODES,
    ConfigError,
    DeviceError,
    Interrupted,
    ModelError,
    OutputError,
    PtbrError,
    error_line,
    interrupted,
)
from ptbr.files import (
    first_line,
    first_missing,
    probe_writable,
    read_json,
    remove_empty_folders,
    remove_leftovers,
    unwritable_fix,
    write_json,
    writing,
)
from ptbr.lock import LOCK_FILE, RunLock, held_if_free, refuse_if_in_use
from ptbr.log import attach_run_log, detach, log, to_file_only
from ptbr.memory import Architecture, estimate_run
from ptbr.outputs import folder_refusal, input_refusal
from ptbr.report import matplotlib_installed, write_report
from ptbr.train.checkpoint import (
    STATE_FILE,
    checkpoints_dir,
    complete_checkpoints,
    corruption,
    read_state,
    why_incomplete,
)
from ptbr.train.loop import OPTIMIZER_SETTINGS, LoopState, TrainingStep
from ptbr.train.metrics import loss_summary, require_tensorboard
from ptbr.train.schedule import Schedule
from ptbr.versions import install_extra

# What a run leaves in its directory. A run that starts over moves these to OUTPUT/previous/ (the
# lock, train.log, which holds every session's lines, and preflight's files stay).
RUN_FILES = ("checkpoints", "final", "adapters", "merged", "metrics.jsonl", "metrics.csv", "training_summary.json",
             "run_config.json", "crash_report.txt", "hang_report.txt", "report.md", "plots", "tensorboard")
PREVIOUS = "previous"


def create_run_dir(output: str) -> Path:
    run_dir = Path(output)
    _refuse_a_folder_that_cannot_hold_a_run(run_dir)
    try:
        probe_writable(run_dir)
    except OSError as exc:
        raise OutputError(f"cannot create or write the output directory: {exc.strerror or exc}", str(run_dir),
                          unwritable_fix(exc)) from exc
    return run_dir


def _refuse_a_folder_that_cannot_hold_a_run(output) -> None:
    """A file, a folder inside another run, a dataset's or a model's (ptbr/outputs.py folder_refusal)."""
    refused = folder_refusal(output)
    if refused:
        raise OutputError(refused[0], str(output), refused[1])


def refuse_an_input_as_output(settings) -> None:
    """The run's --output may not be the directory of its --data, --valid or --base (ptbr/outputs.py)."""
    refused = input_refusal(settings)
    if refused:
        raise OutputError(refused[0], str(settings.output), refused[1])


def check_before_launch(settings) -> None:
    """What a run in one process refuses within its first second, refused before a data-parallel
    launch starts its workers (each would import torch and build its backend first, then fail with
    the same line, seconds later): the --output (another run's, in use), and the data's files being there."""
    refuse_an_input_as_output(settings)
    _refuse_a_folder_that_cannot_hold_a_run(settings.output)
    refuse_if_in_use(Path(settings.output))  # before the launch writes its workers' logs into it
    if settings.command == "finetune":
        from ptbr.finetune.data import data_paths

        data_paths(settings.data, settings.valid)
    else:
        from ptbr.data import SAMPLE_DIR
        from ptbr.data.tokens import open_dataset

        open_dataset(settings.data or SAMPLE_DIR, settings.tokenizer)


@contextmanager
def closing_world(world: World) -> Iterator[World]:
    """Close a data-parallel run's world (destroy its process group, whose threads would otherwise
    run on while the process exits) when the run ends well, or stops on a signal: every rank then
    stops at the same step boundary, after the same checkpoint. Not after a failure, when another
    rank may still wait inside a collective for this one."""
    try:
        yield world
    except Interrupted as stop:
        # the finished frames of its traceback hold the run's model and DDP wrapper, which hold
        # the group: their locals go (the traceback still shows where it was raised)
        traceback.clear_frames(stop.__traceback__)
        world.close()
        raise
    world.close()


# where a data-parallel launch puts the ranks' logs but rank 0's, in the run directory
WORKER_LOGS = "workers"


@contextmanager
def open_run(settings, world: World | None = None) -> Iterator[Path]:
    """The run directory, created, locked against a second run, and logged to train.log while the
    `with` block runs; the line of an error that ends the run goes to train.log too. With
    --resume never, the previous run's files are moved aside first. In a data-parallel run the
    main rank does all of this and the other ranks wait for it (and fail with it)."""
    if settings.tensorboard:
        require_tensorboard()  # before anything is written or built
    refuse_an_input_as_output(settings)
    world = world or SingleProcess()
    held: dict = {}

    def open_on_main() -> str:
        held["made"] = first_missing(Path(settings.output))  # the topmost folder it creates
        held["created"] = held["made"] is not None
        run_dir = create_run_dir(settings.output)
        held["lock"] = RunLock(run_dir).acquire()
        remove_leftovers(run_dir)  # writes cut short by a crash (we hold the lock)
        remove_leftovers(checkpoints_dir(run_dir))
        held["log"] = attach_run_log(run_dir)
        if settings.resume == "never":
            moved = move_previous_run(run_dir)
            if moved is not None:
                log(f"--resume never: starting over; the previous run's files were moved to {moved}")
        return str(run_dir)

    stopped_before_any_work = stopped_while_opening = False
    try:
        run_dir = Path(world.decide(open_on_main))
        yield run_dir
    except BaseException as exc:
        if "log" in held and not isinstance(exc, SystemExit):
            # the line the CLI prints, fix included (not a crash where another rank's process went away)
            if isinstance(exc, KeyboardInterrupt):
                line = interrupted(exc, settings.command).one_line()
            else:
                by_another = world.stopped_by_another(exc, settings.command)
                line = (by_another.one_line() if by_another is not None
                        else error_line(exc, "crash_report.txt in this directory"))
            to_file_only(held["log"], line)
        # a user's error (bad data, a checkpoint refused) or a stop before the run trained: the
        # directory this run made holds only its log, lock and run_config.json (bad validation data
        # is found after it is written), and would read as a run that started.
        # Only a run that held the lock removes it: a run that lost the lock to another one started
        # at the same moment would delete the winner's directory
        stopped_before_any_work = (isinstance(exc, PtbrError | KeyboardInterrupt) and held.get("created", False)
                                   and "lock" in held)
        # stopped between making the directory and holding its lock (a Ctrl-C at the start): removed
        # where no run holds the lock now (one that does made it, or took it first)
        stopped_while_opening = (isinstance(exc, PtbrError | KeyboardInterrupt) and held.get("created", False)
                                 and "lock" not in held)
        raise
    finally:
        if "log" in held:
            detach(held["log"])
        if stopped_before_any_work:
            _remove_if_only_its_log(Path(settings.output), also=_BEFORE_TRAINING)  # still holding the lock
        if "lock" in held:
            held["lock"].release()
        elif stopped_while_opening:
            with held_if_free(Path(settings.output)) as free:
                if free:
                    _remove_if_only_its_log(Path(settings.output))
        if held.get("made") is not None and (stopped_before_any_work or stopped_while_opening) \
                and not Path(settings.output).exists():
            remove_empty_folders(Path(settings.output).parent, held["made"])  # the parents it made on the way


# what a run writes before its first step: its settings, and its metrics files without a row
# (and --tensorboard's folder)
_BEFORE_TRAINING = frozenset({"run_config.json", "metrics.jsonl", "metrics.csv", "tensorboard"})


def _remove_if_only_its_log(run_dir: Path, also: frozenset[str] = frozenset()) -> None:
    try:
        names = {p.name for p in run_dir.iterdir()}
        logged_a_step = "metrics.jsonl" in names and (run_dir / "metrics.jsonl").stat().st_size > 0
        if names <= {"train.log", LOCK_FILE, *also} and not logged_a_step:
            shutil.rmtree(run_dir)
    except OSError:
        pass  # left as it is: the error line said what went wrong


def remove_a_launch_that_never_started(run_dir: Path, code: int, made: Path | None = None) -> None:
    """After a data-parallel launch that failed with `code`, in an --output it created: the
    directory, where it holds only the log, the lock, run_config.json and the workers' logs (the
    ranks stopped before the run trained), as a run in one process leaves none. Kept after a crash or a killed rank
    (exit 1: the workers' logs are what says why) and while another run holds its lock (one started
    into the same new --output at the same moment, which won the lock: its directory)."""
    if code in (1, 0) or code not in EXIT_CODES:
        return
    with held_if_free(run_dir) as free:
        if free:
            _remove_if_only_its_log(run_dir, also=_BEFORE_TRAINING | {WORKER_LOGS})
    if made is not None and not run_dir.exists():
        remove_empty_folders(run_dir.parent, made)  # the parents the launch made on the way


# what keeping freed memory on a CPU can hold, as a multiple of the predicted peak (the most measured:
# 1.76x, `tiny` at 128 x 256 in two micro-batches; see backends/torch/allocator.py)
FREED_MEMORY_HELD = 2.0
OUT_OF_MEMORY_FIX = ("run with --auto-fit (it finds the micro-batch that fits), or lower --batch-size (raising "
                     "--grad-accum), turn on --gradient-checkpointing, or ask `ptbr preflight` for a config that fits")


@contextmanager
def out_of_memory_is_an_error(backend) -> Iterator[None]:
    """Without --auto-fit, running out of memory is the user's to fix (exit 5), not a crash."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, PtbrError) or not backend.is_out_of_memory(exc):
            raise
        raise DeviceError(f"out of memory on {backend.device}: {first_line(exc)[:160]}", "training",
                          f"{OUT_OF_MEMORY_FIX}; a resume continues from the last checkpoint where one was "
                          "written") from exc


def plan_host_memory(predicted: int | None, backend, settings) -> None:
    """A torch run on a CPU, once its predicted peak (the runtime and the weights included) is known,
    against what this process holds now and the memory still free (RAM available, a container's
    memory limit where it has one; ptbr/ram.py). A data-parallel run's processes on this machine
    (LOCAL_WORLD_SIZE) each reach that peak, from the same RAM: once every rank is there, the main
    rank counts what all of them still need (the others' memory held so far is in use already)
    and decides for every rank (with several machines, its own machine stands for each).

    - The run is refused (exit 5) where the peak needs more than that and free swap: out of memory,
      the kernel kills it (or one process of several), no line, exit 137, a run directory that
      looks dead. Not with --auto-fit (it picks a micro-batch that fits; one process only), not on
      MLX (macOS's unified memory compresses and purges: "available" says little there).
    - The speed lever of keeping freed memory (backends/torch/allocator.py) is set only where the
      peak times FREED_MEMORY_HELD still fits, without swap: glibc's heap grows with what
      micro-batches free and ask for in other sizes (`tiny` at 64 x 256, fp32: 1.16x the predicted
      peak in one micro-batch, 1.52x in four; 1.76x at 128 x 256 in two; with freed blocks returned
      0.88-0.93x). Otherwise freed blocks keep going back, and the log says why."""
    if predicted is not None and backend.name == "torch" and backend.device.split(":")[0] == "cpu":
        processes = 1 if backend.world.size == 1 else processes_on_this_machine(backend.world.size)
        if processes > 1:  # every rank as far along (a fine-tuning base loads at its own pace) before the read
            backend.world.barrier()
        # the main rank decides for all: each rank reading the memory alone could get its own answer
        not_kept = backend.world.decide(lambda: _read_host_memory(predicted, processes, settings))
        if not_kept:
            log(not_kept)
            return
    said = backend.keep_freed_memory()
    if said:
        log(said)


def _read_host_memory(predicted: int, processes: int, settings) -> str | None:
    """plan_host_memory's reading of this machine's memory: raises DeviceError where the peak cannot
    fit; returns why freed memory is not kept where keeping it could not fit (None where it can)."""
    import psutil

    from ptbr.ram import ram

    held = psutil.Process().memory_info().rss  # the runtime, and a fine-tuning run's base already loaded
    memory = ram()
    if not settings.auto_fit:
        free = memory.free_with_swap()
        if processes * (predicted - held) > free:
            more = processes * (predicted - held) / 2**30
            what = f"under {memory.where()} ({memory.limit / 2**30:.1f} GiB)" if memory.limit else "(RAM and swap)"
            if processes == 1:
                said = (f"the memory model predicts a peak of {predicted / 2**30:.1f} GiB, {more:.1f} GiB "
                        "more than this process holds")
                fix = OUT_OF_MEMORY_FIX
            else:
                said = (f"the memory model predicts a peak of {predicted / 2**30:.1f} GiB in each of the "
                        f"{processes} processes on this machine, {more:.1f} GiB more than they hold")
                fewer = "1" if processes == 2 else f"{processes - 1} or fewer"
                fix = (f"run fewer processes (--num-processes {fewer}: on a CPU they share its cores and "
                       "RAM), or lower --batch-size (raising --grad-accum), or turn on --gradient-checkpointing")
            raise DeviceError(f"{said}, and {free / 2**30:.1f} GiB is free {what}: the kernel would kill "
                              "the run", f"--batch-size {settings.batch_size}", fix)
    if processes * (predicted * FREED_MEMORY_HELD - held) > memory.available:
        each = " in each of its processes" if processes > 1 else ""
        return (f"glibc's malloc returns what steps free: keeping it (faster steps on a CPU) can hold "
                f"{FREED_MEMORY_HELD:.1f}x the predicted peak of {predicted / 2**30:.1f} GiB{each}, more than "
                f"the {memory.available / 2**30:.1f} GiB of {memory.where()} available")
    return None


def move_previous_run(run_dir: Path, only: list[Path] | None = None) -> Path | None:
    """Move what a previous run left (RUN_FILES, or just `only`) to OUTPUT/previous/TIMESTAMP/.
    Returns that folder, or None when there was nothing to move."""
    found = only if only is not None else [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    if not found:
        return None
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H-%M-%SZ")
    target = run_dir / PREVIOUS / stamp
    suffix = 1
    while target.exists():
        suffix += 1
        target = run_dir / PREVIOUS / f"{stamp}-{suffix}"
    try:
        for path in found:
            destination = target / path.relative_to(run_dir)
            destination.parent.mkdir(parents=True, exist_ok=True)
            try:
                path.rename(destination)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                # OUTPUT/previous on another file system (a link or a mount there): copied, then removed
                shutil.move(str(path), str(destination))
    except OSError as exc:
        raise OutputError(f"cannot move the previous run's files aside: {exc.strerror or exc}", str(run_dir),
                          "check the permissions of the output directory, or choose another --output") from exc
    return target


# --------------------------------------------------------------------------------------------
# Resuming
# --------------------------------------------------------------------------------------------


@dataclass
class Resume:
    """Where a run starts: a checkpoint (with its trainer state and schedule), or nowhere."""

    checkpoint: Path | None = None
    state: dict | None = None
    schedule: Schedule | None = None


def find_resume(run_dir: Path, settings, identity: dict, world: World | None = None) -> Resume:
    """The checkpoint to continue from, per --resume auto|never|PATH, checked against the run
    (`identity`, `settings`) before any model is built. Raises ConfigError for a checkpoint of
    another run or past --max-steps, ModelError for a named checkpoint that is missing or corrupt.
    In a data-parallel run the main rank decides (it may move files aside) and every rank gets
    the same answer."""
    return (world or SingleProcess()).decide(lambda: _find_resume(run_dir, settings, identity))


def _find_resume(run_dir: Path, settings, identity: dict) -> Resume:
    if settings.resume == "never":
        return Resume()  # open_run moved the previous run aside
    if settings.resume == "auto":
        path, state = _newest_usable(run_dir, settings, identity)
        if path is None:
            return Resume()
    else:
        path = Path(settings.resume).expanduser()
        if not path.exists():
            import difflib

            meant = difflib.get_close_matches(settings.resume, ["auto", "never"], n=1, cutoff=0.6)
            if meant:  # a keyword mistyped, not a checkpoint that went missing
                raise ConfigError(f"--resume {settings.resume}: no such checkpoint, and not auto or never",
                                  "--resume", f"did you mean --resume {meant[0]}?")
        if not path.is_dir():
            raise ModelError("checkpoint not found" if not path.exists() else "a file, not a checkpoint directory",
                             str(path),
                             "give a checkpoints/step_NNNNNN directory, or --resume auto or never")
        state = read_state(path)
        if state is None and not (path / STATE_FILE).is_file():
            raise ModelError("not a checkpoint (it has no trainer_state.json)", str(path),
                             "give a checkpoints/step_NNNNNN directory, or --resume auto or never")
        if state is None:
            raise ModelError(f"the checkpoint is incomplete or malformed: {why_incomplete(path)}",
                             str(path), "give another checkpoint, or --resume auto to pick the newest complete one")
        _check_belongs(path, state, settings, identity, named=True)
        problem = corruption(path, state)
        if problem:
            raise ModelError(f"the checkpoint is corrupt: {problem}", str(path),
                             "give another checkpoint, or --resume auto to pick the newest intact one")
        _set_aside_other_checkpoints(run_dir, path, state["step"])
    schedule = Schedule.from_dict(state["scheduler"])
    _log_resume(path, state, schedule, settings)
    return Resume(path, state, schedule)


def _newest_usable(run_dir: Path, settings, identity: dict) -> tuple[Path | None, dict | None]:
    """--resume auto: the newest intact checkpoint of this run. A checkpoint of another run is
    refused (not skipped: its older siblings belong to that run too); corrupt ones are set aside."""
    found = complete_checkpoints(run_dir)
    for path in reversed(found):
        state = read_state(path)
        _check_belongs(path, state, settings, identity)
        problem = corruption(path, state)
        if problem is None:
            return path, state
        aside = move_previous_run(run_dir, [path])
        log(f"warning: checkpoint {path.name} is corrupt ({problem}): moved to {aside}; trying the previous one")
    moved = move_previous_run(run_dir)  # what a run that never saved a usable checkpoint left
    if moved is not None:
        log(f"no usable checkpoint to resume from: starting over; the previous run's files were moved to {moved}")
    return None, None


def identity_problems(recorded: dict | None, requested: dict) -> list[str]:
    """What differs between the run a checkpoint belongs to and the requested run."""
    if not recorded:
        return ["the checkpoint records no run identity (it was written by an older ptbr)"]
    if recorded.get("mode") != requested.get("mode"):
        kinds = {"pretrain": "a pretraining (ptbr train)", "finetune": "a fine-tuning (ptbr finetune)"}
        return [f"it is {kinds.get(recorded.get('mode'), repr(recorded.get('mode')))} checkpoint and this is "
                f"{kinds.get(requested['mode'], requested['mode'])} run"]
    recorded, requested = OPTIONAL_IDENTITY | recorded, OPTIONAL_IDENTITY | requested
    hints = IDENTITY_HINTS | {"backend": f" (--backend {recorded.get('backend')} resumes it)"}
    return [f"{key} is {recorded.get(key)!r} in the checkpoint, {requested.get(key)!r} now"
            + hints.get(key, "") for key in requested
            if key != "mode" and recorded.get(key) != requested.get(key)
            and (key in recorded or key not in NEWER_IDENTITY)]


# keys of a run's identity written only when not at their default (what older checkpoints, which
# lack them, were run with)
OPTIONAL_IDENTITY = {"group_by_length": False}


# keys of a run's identity that older checkpoints lack altogether: compared where recorded
NEWER_IDENTITY = {"base_weights", "lora_dropout"}


# what a fingerprint in a run's identity covers, for the line that says it differs
IDENTITY_HINTS = {
    "train_data": " (the training data as encoded: its files or tokenizer changed, or, fine-tuning, the chat "
                  "template, --max-seq-len or --drop-long)",
    "base_files": " (the base model's files changed)",
    "base_weights": " (the base model's weights changed: retrained or saved again in place)",
}


def schedule_problems(schedule: Schedule, settings) -> list[str]:
    """A resumed run continues on its checkpoint's schedule: a different peak or floor, or an
    explicitly different warmup, would silently change it."""
    found = []
    if settings.learning_rate != schedule.peak_lr:
        found.append(f"learning_rate is {schedule.peak_lr:g} in the checkpoint, {settings.learning_rate:g} now")
    if settings.min_lr_ratio != schedule.min_lr_ratio:
        found.append(f"min_lr_ratio is {schedule.min_lr_ratio:g} in the checkpoint, {settings.min_lr_ratio:g} now")
    derived = settings.warmup_steps == default_warmup(settings.max_steps)
    if not derived and settings.warmup_steps != schedule.warmup_steps:
        found.append(f"warmup_steps is {schedule.warmup_steps} in the checkpoint, {settings.warmup_steps} now")
    return found


def optimizer_problems(recorded, settings) -> list[str]:
    """AdamW's weight decay and betas: torch's optimizer state restores the checkpoint's (a new
    value would be recorded and never used), MLX's would take the new one; neither silently.
    Checkpoints of older versions record none."""
    if not isinstance(recorded, dict):
        return []
    return [f"{name} is {recorded[name]:g} in the checkpoint, {getattr(settings, name):g} now"
            for name in OPTIMIZER_SETTINGS if isinstance(recorded.get(name), int | float)
            and recorded[name] != getattr(settings, name)]


def _check_belongs(path: Path, state: dict, settings, identity: dict, named: bool = False) -> None:
    problems = identity_problems(state.get("run", {}).get("identity") if isinstance(state.get("run"), dict) else None,
                                 identity)
    if not problems and "scheduler" in state:
        problems = schedule_problems(Schedule.from_dict(state["scheduler"]), settings)
    if not problems:
        problems = optimizer_problems(state.get("optimizer"), settings)
    if problems and named:  # --resume PATH: another --output would not change what PATH is
        raise ConfigError(f"the checkpoint belongs to another run: {'; '.join(problems)}", str(path),
                          "rerun with the settings of the run it belongs to, or give --resume another checkpoint "
                          "(or --resume never to start over)")
    if problems:
        raise ConfigError(f"the checkpoint belongs to another run: {'; '.join(problems)}", str(path),
                          "rerun with the first run's settings, or start over with --resume never (the old run's "
                          "files are moved to OUTPUT/previous/), or use another --output")
    step = int(state["step"])
    if step > settings.max_steps:
        raise ConfigError(f"the checkpoint is at step {step}, past --max-steps {settings.max_steps}", str(path),
                          f"give --max-steps {step} or more to continue it, or start over with --resume never")


def _set_aside_other_checkpoints(run_dir: Path, chosen: Path, step: int) -> None:
    """--resume PATH: checkpoints of this directory that a later --resume auto would prefer (newer
    than PATH, or every one when PATH is elsewhere) are moved aside; so is a previous run's output."""
    inside = chosen.resolve().parent == checkpoints_dir(run_dir).resolve()
    if inside:
        newer = [p for p in complete_checkpoints(run_dir, quiet=True) if p.resolve() != chosen.resolve()
                 and (read_state(p) or {}).get("step", 0) > step]
        moved = move_previous_run(run_dir, newer) if newer else None
        if moved is not None:
            # the resumed run cuts its metrics back to `step`: the rows of the steps set aside go with them
            for name in ("metrics.jsonl", "metrics.csv"):
                if (run_dir / name).is_file():
                    with writing("the metrics set aside", moved):
                        shutil.copy2(run_dir / name, moved / name)
            log(f"resuming from step {step}: the {len(newer)} newer checkpoint(s) were moved to {moved}, with a "
                "copy of the metrics of every step so far")
    else:
        moved = move_previous_run(run_dir)
        if moved is not None:
            log(f"resuming from {chosen}: this directory's previous run was moved to {moved}")


def _log_resume(path: Path, state: dict, schedule: Schedule, settings) -> None:
    step = int(state["step"])
    log(f"resuming from {path} (step {step})")
    # (the last step is --max-steps, or --epochs' count for a fine-tuning run given none: named by number)
    if step == settings.max_steps:
        log(f"the run already reached its last step, {settings.max_steps}: writing its results again")
    elif settings.max_steps > schedule.horizon:
        floor = schedule.peak_lr * schedule.min_lr_ratio
        log(f"training to step {settings.max_steps} goes past the {schedule.horizon} steps the schedule was planned "
            f"for: steps {max(step, schedule.horizon) + 1}-{settings.max_steps} train at its final learning rate "
            f"{floor:.2e}")
    elif settings.max_steps < schedule.horizon:
        log(f"stopping at step {settings.max_steps} comes before the end of the schedule (planned for "
            f"{schedule.horizon} steps): the learning rate will not have decayed fully")


def start_state(step: TrainingStep, resume: Resume) -> LoopState:
    """The loop's state at the start: fresh, or the checkpoint's, loaded into the training step
    (weights, optimizer, scaler, RNG). A checkpoint that fails to load is one ModelError."""
    if resume.checkpoint is None:
        return LoopState()
    try:
        step.load_state(resume.checkpoint)
    except Exception as exc:  # noqa: BLE001 - whatever the library raises, the checkpoint cannot be used
        reason = type(exc).__name__ if "weights_only" in str(exc) else str(exc).strip().splitlines()[0][:200]
        raise ModelError(f"cannot load the checkpoint: {reason}", str(resume.checkpoint),
                         "resume from another checkpoint (--resume PATH), or start over with --resume never") from exc
    return LoopState.from_dict(resume.state["loop"])


# --------------------------------------------------------------------------------------------
# run_config.json and training_summary.json
# --------------------------------------------------------------------------------------------


def effective_batch(settings, world: World) -> int:
    """Sequences (or examples) per optimizer step: micro-batch x accumulation x processes."""
    return settings.batch_size * settings.grad_accum * world.size


def warn_if_warmup_outlasts_the_run(settings) -> None:
    """A warmup as long as the run (e.g. --warmup-steps 100 with --max-steps 20) is allowed, but
    the learning rate then rises for the whole run and never reaches the peak that was asked for."""
    if settings.warmup_steps > settings.max_steps:
        log(f"warning: --warmup-steps {settings.warmup_steps} is more than --max-steps {settings.max_steps}: the "
            "learning rate rises for the whole run and never reaches its peak (--learning-rate)")


def describe_placement(backend, settings) -> str:
    world = backend.world
    line = f"backend {backend.name}, device {backend.device}, precision {backend.precision} ({backend.reason})"
    if world.size > 1:
        line += (f"; data parallel over {world.size} processes: batch {settings.batch_size} x grad_accum "
                 f"{settings.grad_accum} x {world.size} processes = {effective_batch(settings, world)} per step")
    return line


def refuse_auto_fit_in_parallel(settings, world: World) -> None:
    if settings.auto_fit and world.size > 1:
        raise ConfigError("--auto-fit runs in one process, not in a data-parallel run", "--auto-fit",
                          "find the micro-batch with `ptbr preflight` (or --auto-fit in one process), then launch "
                          "the parallel run with it")


def predicted_peak_bytes(settings, arch: Architecture, backend, batch_size: int, seq_len: int) -> int:
    """The memory model's peak for this run on its backend and device (per process in a
    data-parallel run), recorded in run_config.json so that `ptbr monitor` and `ptbr report` can
    set the measured memory (the main rank's) against it."""
    target = "mlx" if backend.name == "mlx" else backend.device.split(":")[0]
    predicted = estimate_run(settings, arch, target, batch_size, seq_len, backend.precision,
                             settings.gradient_checkpointing, backend.world.size,
                             grad_accum=settings.batch_size * settings.grad_accum // batch_size)
    # set against what the backend measures: MLX's allocator peak holds the tensors, not the
    # interpreter and libraries around them (the runtime a plan adds, as RSS on CPU includes it)
    return predicted.total - (predicted.overhead if backend.name == "mlx" else 0)


def write_run_config(run_dir: Path, command: str, settings, backend, resume: Resume, extra: dict) -> None:
    """run_config.json (written by the main rank)."""
    if not backend.world.is_main:
        return
    # the run_config.json a resumed run's directory already holds (none or unreadable: no note)
    before = (read_json(run_dir / "run_config.json") if resume.checkpoint else None) or {}
    # a finished run run again trains no step here: it was trained as its run_config.json says
    trains = resume.state is None or int(resume.state.get("step", 0)) < settings.max_steps
    placement = {"device": backend.device, "precision": backend.precision}
    if not trains and before.get("precision"):
        placement = {"device": before.get("device", backend.device), "precision": before["precision"]}
    elif before.get("precision") not in (None, backend.precision):  # allowed (another GPU, say), but said
        log(f"note: this run trained in {before['precision']} until now and goes on in {backend.precision}; "
            f"--precision {before['precision']} continues as it was")
    recorded = dataclasses.asdict(settings)
    schedule = resume.schedule or Schedule.from_settings(settings)
    # the schedule it follows is the checkpoint's: a warmup derived from a new --max-steps is not it
    recorded["warmup_steps"] = schedule.warmup_steps
    write_json(run_dir / "run_config.json", {
        "command": command,
        "settings": recorded,
        "schedule": schedule.as_dict(),
        **extra,
        "backend": backend.name, **placement,
        "processes": backend.world.size, "effective_batch": effective_batch(settings, backend.world),
        "versions": backend.versions(),
        "resumed_from": str(resume.checkpoint) if resume.checkpoint else None,
    }, "run_config.json")


def finish(run_dir: Path, state: LoopState, session_started: float, extra: dict, result: str,
           report: bool = True) -> dict:
    """training_summary.json (the run's numbers and `extra`), the run's report (unless `report` is
    False: `ptbr smoke`'s check run), and the last log line."""
    summary = {
        "steps": state.step,
        "tokens_seen": state.tokens_seen,
        **loss_summary(run_dir),
        "best_val_loss": state.best_val_loss,
        "best_step": state.best_step,
        "skipped_steps": state.skipped_steps,
        "elapsed_s": round(state.elapsed_s, 6),
        "this_session_s": round(time.monotonic() - session_started, 3),
        **extra,
    }
    write_json(run_dir / "training_summary.json", summary, "training_summary.json")
    if report:
        write_run_report(run_dir)
    line = f"done: {state.step} step{'s' if state.step != 1 else ''}"
    if summary["final_loss"] is not None:
        line += f", final loss {summary['final_loss']:.4f}"
    if state.best_val_loss is not None:
        line += f", best val_loss {state.best_val_loss:.4f} (step {state.best_step})"
    log(f"{line}; {result}")
    return summary


def write_run_report(run_dir: Path) -> None:
    """report.md and plots/ of a run that finished, where matplotlib is installed. The run's results
    are saved by then: a report that cannot be made is a warning, never the run's failure."""
    if not matplotlib_installed():
        log("no report: matplotlib is not installed; " + install_extra(
            "report", f"run `ptbr report` on the host, on {run_dir} in the /out volume", f", then `ptbr report {run_dir}`"))
        return
    try:
        path = write_report([run_dir])
    except Exception as exc:  # noqa: BLE001 - whatever went wrong, the trained model is saved
        log(f"warning: the run report was not written ({error_line(exc)}); the run's results are saved: "
            f"`ptbr report {run_dir}` tries again")
        return
    log(f"report: {path}, plots in {path.parent / 'plots'}")
