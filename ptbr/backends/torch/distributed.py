"""Data parallelism for the torch backend: the process group of a run started by torchrun,
`accelerate launch`, or ptbr's own --num-processes (which starts torchrun's launcher itself).

Each rank holds the whole model (DDP) or a shard of it (--fsdp); TorchStep averages the gradients
with the token-weighted loss of the whole global step, so that any world size trains the same
model. This module only sets the processes up and lets them agree.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import sys
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

from ptbr.backends.world import shared
from ptbr.cpus import usable_cpus
from ptbr.errors import EXIT_CODES, DeviceError, Interrupted, PtbrError
from ptbr.files import write_text
from ptbr.lock import held_if_free
from ptbr.log import attach_run_log, detach, to_file_only

T = TypeVar("T")

# Collectives wait this long before torch gives up; ptbr's hang watchdog (--hang-timeout) reports a
# stuck rank long before, with its stack.
COLLECTIVE_TIMEOUT = timedelta(hours=2)


def world_from_env():
    """The run's world as torchrun/accelerate describe it in the environment; None for one process."""
    size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if size <= 1:
        return None
    return TorchWorld(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")))


class TorchWorld:
    """The ranks of a torch.distributed process group (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, rank: int, size: int, local_rank: int):
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self.device = None

    def start(self, device) -> TorchWorld:
        """Join the process group; `device` is this rank's (collectives run there: NCCL needs the GPU)."""
        import torch.distributed as dist

        self.device = device
        if not dist.is_initialized():
            _import_what_would_keep_the_group_alive()
            backend = "nccl" if device.type == "cuda" else "gloo"
            try:
                dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT,
                                        device_id=device if device.type == "cuda" else None)
            except Exception as exc:  # noqa: BLE001 - a rendezvous that cannot form is a device problem
                raise DeviceError(f"cannot join the {self.size}-process group as rank {self.rank} ({backend}): "
                                  f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                                  f"MASTER_ADDR={os.environ.get('MASTER_ADDR')} MASTER_PORT="
                                  f"{os.environ.get('MASTER_PORT')}", "check the launcher's rendezvous settings; "
                                  "on machines where NCCL hangs between GPUs, set NCCL_P2P_DISABLE=1") from exc
        return self

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def any(self, flag: bool) -> bool:
        import torch
        import torch.distributed as dist

        value = torch.tensor([1 if flag else 0], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the ranks (float64: token counts stay exact)."""
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(self, value):
        """Every rank's `value`, in rank order, on every rank."""
        import torch.distributed as dist

        gathered = [None] * self.size
        dist.all_gather_object(gathered, value)
        return gathered

    def decide(self, decision: Callable[[], T]) -> T:
        import torch.distributed as dist

        outcome = shared(decision) if self.is_main else (None, None)
        payload = [outcome if not self.is_main or _picklable(outcome) else
                   (None, RuntimeError(f"{type(outcome[1]).__name__}: {outcome[1]}"))]
        dist.broadcast_object_list(payload, src=0)
        result, error = outcome if self.is_main else payload[0]
        if error is not None:
            raise error
        return result

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def describe(self) -> str:
        return f"{self.size} processes (rank {self.rank})"

    def close(self) -> None:
        """Destroy the process group, and with it gloo's threads, which would otherwise race the
        process's exit (tests/test_parallel.py checks that none is left)."""
        import torch.distributed as dist

        if dist.is_initialized():
            _release_what_holds_the_group()
            dist.destroy_process_group()

    def stopped_by_another(self, exc: BaseException, command: str) -> Interrupted | None:
        return stopped_by_another_rank(exc, command)


def exit_a_failed_rank(code: int) -> None:
    """A rank of several that fails ends here, at once, with its exit code `code`. Its process group
    stays open (ptbr/runs/common.py closing_world: another rank may still wait in a collective for
    this one, and destroying the group could wait with it), and the group's threads (gloo's) can
    then abort the interpreter as it exits ("terminate called without an active exception",
    SIGABRT): the launcher would see -6, not the rank's documented code, and the run would end with
    exit code 1. The logs, the standard streams and C's stdio buffers are flushed first; os._exit
    then skips the interpreter's teardown, atexit hooks included (ptbr registers none: the run's
    lock, logs, metrics and temporary directories are released before main() returns). Returns
    where no group of several processes is open (one process, a run that closed its group, the
    launcher itself), and where torch's own import was cut short (a Ctrl-C at start-up: importing
    it again would raise from its half-made modules)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
    except (AttributeError, RuntimeError):  # a half-imported torch has no group
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that has gone, a closed stream: nothing to keep
            pass
    try:  # what native code wrote through C's stdio (a rank's output redirected to a file is buffered)
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(code)


# what a collective (or the rendezvous store) says when another rank's process has gone: gloo's and
# the store's sockets, NCCL's remote errors (lower case)
ANOTHER_RANK_GONE = ("connection reset by peer", "connection closed by peer", "broken pipe", "remote process exit",
                     "ncclremoteerror")


def stopped_by_another_rank(exc: BaseException, command: str) -> Interrupted | None:
    """What to say where `exc` ended a rank of several because another rank's process went away
    (killed, or ended by its own error) while this one waited for it in a collective: this rank
    stopped, it did not crash (no crash report, no "bug in ptbr"), and the rank that went first
    says why (the launcher's last line names it). Exit code 130, which the launcher counts as a
    rank stopped because of another, as it counts its own SIGTERM. None for anything else."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        rank, size = dist.get_rank(), dist.get_world_size()
    except (AttributeError, RuntimeError):  # a half-imported torch, a group torn down: no group
        return None
    network_error = getattr(dist, "DistNetworkError", ())
    seen, cause = set(), exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        message = str(cause).strip()
        if isinstance(cause, network_error) or (isinstance(cause, RuntimeError)
                                                and any(s in message.lower() for s in ANOTHER_RANK_GONE)):
            # gloo's first sentence, without its source file ([.../gloo/transport/tcp/pair.cc:537] Read error
            # [127.0.0.1]:27031: Connection reset by peer. This is typically caused by ...)
            first = message.splitlines()[0].split(". ")[0] if message else type(cause).__name__
            reason = re.sub(r"^\[[^\]]*\]\s*", "", first)
            return Interrupted(f"rank {rank} of {size} stopped: another rank's process went away while this one "
                               f"waited for it ({reason})", f"ptbr {command}",
                               "see why that rank stopped: the launcher's last line (or, under torchrun, that "
                               "rank's output) names it")
        cause = cause.__cause__ or cause.__context__
    return None


def _import_what_would_keep_the_group_alive() -> None:
    """Some of torch's functions take the default process group as a default argument
    (`group=group.WORLD` in torch.distributed.nn.functional; FSDP's ShardedGradScaler): a module
    first imported after the group exists holds the group itself for good, and
    destroy_process_group can never free it. transformers and DDP import them (through
    torch._dynamo) after the group is made, so gloo's threads outlived every run and ran on while
    the process exited, the likely cause of a rank that now and then aborted after a finished run
    ("terminate called without an active exception", seen in CI). Imported first, their default
    is None (the default group when called); torch._dynamo would be imported anyway."""
    import torch.distributed.fsdp.sharded_grad_scaler  # noqa: F401
    import torch.distributed.nn.functional  # noqa: F401


def _release_what_holds_the_group() -> None:
    """destroy_process_group frees the group only with its last reference. The run's DDP wrapper
    and its TorchStep form a reference cycle that only the garbage collector frees; under FSDP,
    DTensor's caches (sharding, redistribution plans, mesh topology) keep the device mesh for
    good, and the mesh holds the group by name: its registry is emptied (the group is being
    destroyed; no mesh of this run is used again)."""
    import gc

    gc.collect()
    if "torch.distributed.device_mesh" in sys.modules:
        from torch.distributed.device_mesh import DeviceMesh

        for mesh in [o for o in gc.get_objects() if isinstance(o, DeviceMesh)]:
            registry = getattr(mesh, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()


def _picklable(value) -> bool:
    import pickle

    try:
        pickle.dumps(value)
        return True
    except Exception:  # noqa: BLE001
        return False


# --------------------------------------------------------------------------------------------
# --num-processes: ptbr starts the workers itself, with torchrun's launcher
# --------------------------------------------------------------------------------------------


SHUTDOWN_GRACE_S = 600


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch(processes: int, argv: list[str], logs: Path, debug: bool = False) -> int:
    """Run `ptbr ARGV` as `processes` workers on this machine (torchrun --standalone) and return
    the run's exit code: 0, or the documented code of the first rank that failed. Rank 0 writes to
    this terminal; the other ranks' output goes to LOGS/RUN_ID_*/attempt_0/RANK/stderr.log, one
    RUN_ID folder per launch (LOGS is OUTPUT/workers: a failure's line also goes to OUTPUT/train.log).
    SIGTERM/SIGINT reach every rank, which save one checkpoint together and stop (130); a second
    one is passed on as it came, so that a second Ctrl-C stops them at once."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not debug:
        # ptbr reports a failed rank itself, in one line; torch's elastic modules give their loggers a
        # level of their own ("Received 15 death signal, shutting down workers"), so each is set
        for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    logs.mkdir(parents=True, exist_ok=True)
    quiet = {rank: Std.ALL for rank in range(1, processes)}
    options = {}
    if "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)}:  # (not in older torch)
        options["signals_to_handle"] = "SIGHUP,SIGQUIT"  # SIGINT and SIGTERM: _PassingStopSignalsOn
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=processes, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=quiet), **options)
    # the workers share the CPUs this process may use (ptbr/cpus.py; torchrun's own default is 1 thread each)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // processes)))
    # signalled (Ctrl-C, SIGTERM), the launcher passes the signal on and kills the workers after this
    # many seconds: torch's 30 are less than a large checkpoint takes to write (torch >= 2.11 reads it)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_GRACE_S))
    try:
        with _PassingStopSignalsOn(SignalException):
            elastic_launch(config, sys.executable)("-m", "ptbr", *argv)
        return 0
    except SignalException:
        return Interrupted.exit_code  # the workers were told, and saved their checkpoint
    except ChildFailedError as exc:
        return _say_why_a_rank_failed(exc.failures, processes, logs, config.run_id)


class _PassingStopSignalsOn:
    """The launcher's SIGINT and SIGTERM. The first raises torch's SignalException, as torch's own
    handler does: the launcher passes that signal on to every worker and waits for them to save
    their checkpoint (SHUTDOWN_GRACE_S). torch's handler would raise again at the second, cutting
    that wait short, and its launcher then sends every worker SIGTERM and waits once more: a second
    Ctrl-C reached the workers as a first SIGTERM, and the run stopped only after its checkpoint.
    Here a later signal is passed on to the workers as it came (a second SIGINT stops them at once,
    ptbr/train/loop.py GracefulStop) while the launcher goes on waiting for them. Where torch takes
    the signals itself (a torch whose LaunchConfig has no signals_to_handle), GracefulStop takes the
    SIGTERM after a SIGINT for the second Ctrl-C."""

    def __init__(self, signal_exception: type[Exception]):
        import psutil

        self.signal_exception = signal_exception
        self.launcher = psutil.Process()
        self.received: str | None = None
        self.previous = {}

    def __enter__(self) -> _PassingStopSignalsOn:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        sig = signal.Signals(signum)
        workers = [child for child in self.launcher.children() if _leads_a_session(child.pid)]
        if self.received is None:
            if not workers:  # none started yet: the launch stops as any command does (ptbr/cli.py), with a line
                raise KeyboardInterrupt(*([] if sig == signal.SIGINT else [sig.name]))
            self.received = sig.name
            raise self.signal_exception(f"Process {os.getpid()} got signal: {sig}", sigval=sig)
        for worker in workers:
            try:
                os.killpg(worker.pid, sig)  # each worker leads a process group (torch starts it with setsid)
            except OSError:  # it has exited meanwhile
                pass

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _leads_a_session(pid: int) -> bool:
    """A worker of torch's launcher (started with setsid), not another child of the launcher's
    process (multiprocessing's resource tracker, a subprocess of the caller's)."""
    try:
        return os.getsid(pid) == pid
    except OSError:  # it has exited meanwhile
        return False


def _say_why_a_rank_failed(failures: dict, processes: int, logs: Path, run_id: str) -> int:
    """The run's exit code after a launch whose ranks did not all succeed, and its last line: the
    failing rank's own (rank 0 printed it here already), or what killed it. The ranks stopped because
    of it do not count: the launcher's SIGTERM (130, or -15 for a rank that was already exiting), and
    a rank whose collective failed as the other went away (130, stopped_by_another_rank). The line
    also ends OUTPUT/train.log, which `ptbr monitor` and `ptbr report` read."""
    stopped = (Interrupted.exit_code, -signal.SIGTERM)
    failed = {rank: f for rank, f in failures.items() if f.exitcode not in stopped}
    if not failed:  # a stop signal to one rank: every rank saved the checkpoint and stopped
        return Interrupted.exit_code
    documented = {rank: f for rank, f in failed.items() if f.exitcode in EXIT_CODES and f.exitcode != 1}
    killed = {rank: f for rank, f in failed.items() if f.exitcode < 0}
    first = documented or killed or failed  # (a rank that crashed may have done so as another was killed)
    # rank 0's documented error is on this terminal; torch times failures to the second only
    rank = 0 if 0 in documented else min(first, key=lambda r: (first[r].timestamp, r))
    failure = failed[rank]
    # a rank a signal killed: 128 + the signal, as a shell reports a process of its own so killed (137: SIGKILL)
    code = 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode if failure.exitcode in EXIT_CODES else 1
    if rank == 0 and failure.exitcode >= 0:
        return code  # rank 0 said why, here and in train.log
    # this launch's logs (LOGS/RUN_ID_*/attempt_0/RANK/), not an earlier session's
    where = next(iter(sorted(logs.glob(f"{run_id}*/attempt_*/{rank}/stderr.log"))), None) if rank else None
    line = _why_a_rank_stopped(rank, processes, failure.exitcode, where, logs)
    if rank and failure.exitcode == 1 and CRASH_REPORT in line:  # a crash of this rank's: its report says so
        _name_the_rank_in(logs.parent / CRASH_REPORT, rank, processes)
    print(line, file=sys.stderr, flush=True)
    _add_to_the_run_log(logs.parent, line)
    return code


# signals that end a process from inside: a crash in native code (faulthandler prints every stack)
CRASH_SIGNALS = ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL")
# what a rank's unexpected exception leaves in the run directory (ptbr/crash.py)
CRASH_REPORT = "crash_report.txt"


def _why_a_rank_stopped(rank: int, processes: int, exit_code: int, log_file: Path | None, logs: Path) -> str:
    """One line for a rank that failed: the last error line it printed to its log, after its rank
    (`error: rank 1 of 2: ...`: the line alone named no rank), or what a signal that killed it
    usually means (a negative exit code: it had no chance to say anything)."""
    where = str(log_file or (logs if rank else "rank 0's output above"))
    if exit_code >= 0:
        said = [line for line in (log_file.read_text(errors="replace").splitlines() if log_file else [])
                if line.startswith("error: ")]
        if said:  # a line that names no rank yet gets this one's
            ranked = f"error: rank {rank} of {processes}"
            return said[-1] if said[-1].startswith(ranked) else said[-1].replace("error: ", f"{ranked}: ", 1)
        return PtbrError(f"rank {rank} of {processes} stopped with exit code {exit_code}", where,
                         "its log names the problem").one_line()
    try:
        name = signal.Signals(-exit_code).name
    except ValueError:
        name = f"signal {-exit_code}"
    what = f"rank {rank} of {processes} was killed by {name}"
    if name == "SIGKILL":
        what += " (often the out-of-memory killer: `dmesg` or `journalctl -k` says so)"
        fix = ("if memory ran out, lower --batch-size (raising --grad-accum) or ask `ptbr preflight` for a config "
               "that fits; run the same command again to resume from the last checkpoint")
    elif name in CRASH_SIGNALS:
        what += " (a crash in native code: its output ends with every thread's Python stack)"
        fix = "this is a bug in ptbr or a library it uses, please report it with that log"
    else:
        fix = "run the same command again to resume from the last checkpoint"
    return PtbrError(what, where, fix).one_line()


def _name_the_rank_in(report: Path, rank: int, processes: int) -> None:
    """The crash report a rank other than 0 wrote: its first line says which rank it is from (the
    ranks share the run directory, and the report itself names none)."""
    try:
        text = report.read_text(encoding="utf-8")
        if text.startswith("ptbr crash report,"):
            write_text(report, text.replace("ptbr crash report,", f"ptbr crash report of rank {rank} of {processes},",
                                            1), CRASH_REPORT)
    except (OSError, PtbrError):  # unreadable, or a full disk: the report stays as the rank wrote it
        pass


def _add_to_the_run_log(run_dir: Path, line: str) -> None:
    """`line` at the end of run_dir/train.log, where the run wrote one and no run holds it now."""
    if not (run_dir / "train.log").is_file():
        return
    with held_if_free(run_dir) as free:
        if free:
            handler = attach_run_log(run_dir)
            try:
                to_file_only(handler, line)
            finally:
                detach(handler)
