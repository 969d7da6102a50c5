"""`ptbr report` and the report a run writes when it finishes: real PNG plots, report.md's numbers
against metrics.jsonl, the predicted peak a run records, resumes, skipped steps, several runs
overlaid, a missing matplotlib, a full disk; and --tensorboard's event files against metrics.jsonl."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tests.test_finetune as finetune_tests
from ptbr import monitor
from ptbr.cli import main
from ptbr.monitor import smoothed
from ptbr.train.metrics import SCALARS, read_metrics
from tests.conftest import REPO, run_cli, shown_size

pytest.importorskip("matplotlib", reason="the report extra: pip install 'ptbr[report]'")

toy = finetune_tests.toy
TINY = ["--model-size", "tiny", "--seq-len", "32", "--batch-size", "4", "--device", "cpu", "--eval-batches", "2"]
PLOTS = ("loss", "learning_rate", "memory_usage", "throughput")
FIRST_COLOR, SECOND_COLOR = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's C0 and C1


def train(output: Path, *extra: str) -> int:
    return main(["train", "--output", str(output), *TINY, *extra])


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory) -> Path:
    """10 steps in two sessions (6, then resumed to 10), with --tensorboard: the run writes its own report."""
    out = tmp_path_factory.mktemp("report") / "run"
    assert train(out, "--max-steps", "6", "--save-every", "3", "--eval-every", "3", "--tensorboard") == 0
    assert train(out, "--max-steps", "10", "--save-every", "3", "--eval-every", "3", "--tensorboard") == 0
    return out


def table(report: str) -> dict[str, str]:
    """The two-column rows of report.md's summary table."""
    section = report.split("## Summary", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| ([^|]+?) \| (.+) \|$", section, flags=re.M))


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def pixels_of(path: Path, color: tuple[int, int, int]) -> int:
    from PIL import Image

    with Image.open(path) as image:
        return sum(1 for pixel in image.convert("RGB").getdata() if pixel == color)


def test_a_finished_run_writes_its_plots_and_report(resumed_run):
    log = (resumed_run / "train.log").read_text()
    assert f"report: {resumed_run / 'report.md'}, plots in {resumed_run / 'plots'}" in log
    for name in PLOTS:
        path = resumed_run / "plots" / f"{name}.png"
        assert png_size(path) == (800, 450)
        assert path.stat().st_size > 10_000
        assert pixels_of(path, FIRST_COLOR) > 200, f"{name}.png has no curve drawn"
    assert not list(resumed_run.glob(".tmp-*"))


def test_the_report_s_numbers_are_those_of_metrics_jsonl(resumed_run):
    rows = read_metrics(resumed_run / "metrics.jsonl")
    config = json.loads((resumed_run / "run_config.json").read_text())
    summary = json.loads((resumed_run / "training_summary.json").read_text())
    report = (resumed_run / "report.md").read_text()
    shown = table(report)
    losses = [r["loss"] for r in rows]
    vals = [(r["step"], r["val_loss"]) for r in rows if r["val_loss"] is not None]
    assert [r["step"] for r in rows] == list(range(1, 11)) and [s for s, _ in vals] == [3, 6, 9, 10]
    best_step, best = min(vals, key=lambda v: v[1])
    import math
    import statistics

    assert shown["status"] == "finished"
    assert shown["steps"] == "10 of 10"
    assert shown["tokens seen"] == f"{summary['tokens_seen']:,}" == f"{10 * 4 * 32:,}"
    assert shown["train loss"] == (f"first {losses[0]:.4f}, final {losses[-1]:.4f}, "
                                   f"smoothed {smoothed(losses)[-1]:.4f}")
    assert shown["validation loss"] == (f"final {vals[-1][1]:.4f} at step 10 (perplexity {math.exp(vals[-1][1]):.2f}); "
                                        f"best {best:.4f} at step {best_step} (perplexity {math.exp(best):.2f})")
    assert shown["training time"].endswith(f"({rows[-1]['elapsed_s']:.1f} s)")
    assert shown["throughput"] == f"{statistics.median(r['tokens_per_s'] for r in rows):,.1f} tokens/s (median over the steps)"
    peak, predicted = max(r["mem_bytes"] for r in rows), config["predicted_peak_bytes"]
    assert shown["peak memory"] == (f"measured {peak:,} B ({shown_size(peak)}); predicted {predicted:,} B "
                                    f"({shown_size(predicted)}) ({monitor.share_of(peak, predicted)}% of the prediction)")
    assert shown["skipped steps"] == "0"
    assert re.fullmatch(r"1: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d from step 6 \(`.+/checkpoints/step_000006`\)",
                        shown["resumes"]), shown["resumes"]
    assert "| max_steps | 10 |" in report and "| tensorboard | True |" in report
    for name in PLOTS:
        assert f"(plots/{name}.png)" in report


def test_a_run_started_over_forgets_the_previous_run_s_resumes(resumed_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(resumed_run, copy)
    assert train(copy, "--max-steps", "2", "--resume", "never") == 0
    assert "resuming from" in (copy / "train.log").read_text()  # the previous run's lines stay in the log
    shown = table((copy / "report.md").read_text())
    assert shown["steps"] == "2 of 2" and shown["resumes"] == "none"


def test_a_run_records_the_memory_model_s_peak_for_its_settings(resumed_run):
    from ptbr.config import PRESETS
    from ptbr.memory import RUNTIME_BYTES, Architecture, estimate_training_memory

    config = json.loads((resumed_run / "run_config.json").read_text())
    arch = Architecture.from_preset(PRESETS["tiny"], config["model"]["vocab_size"])
    expected = estimate_training_memory(arch, 4, 32, config["precision"], False, RUNTIME_BYTES["cpu"],
                                        chunked_loss=True).total  # the run's default loss
    assert expected != estimate_training_memory(arch, 4, 32, config["precision"], False, RUNTIME_BYTES["cpu"]).total
    assert config["predicted_peak_bytes"] == expected


def test_a_fine_tuning_run_records_its_predicted_peak_and_is_reported(toy, tmp_path):
    from ptbr.config import FinetuneConfig
    from ptbr.finetune.base import load_tokenizer
    from ptbr.memory import Architecture, estimate_run
    from ptbr.runs.finetune import load_data

    out = tmp_path / "run"
    assert main(["finetune", "--base", str(toy.base), "--data", str(toy.data), "--output", str(out), "--quant",
                 "none", "--lora-r", "8", "--batch-size", "4", "--max-steps", "3", "--eval-every", "0"]) == 0
    settings = FinetuneConfig(base=str(toy.base), data=str(toy.data), quant="none", lora_r=8, batch_size=4,
                              max_steps=3)
    train, _ = load_data(settings, load_tokenizer(str(toy.base)))
    longest = max(len(e.ids) for e in train.examples) - 1
    arch = Architecture.from_hf_config(json.loads((toy.base / "config.json").read_text()))
    config = json.loads((out / "run_config.json").read_text())
    assert config["predicted_peak_bytes"] == estimate_run(settings, arch, "cpu", 4, longest, "fp32", False,
                                                          grad_accum=1).total
    shown = table((out / "report.md").read_text())
    assert shown["steps"] == "3 of 3" and shown["status"] == "finished"
    assert (out / "report.md").read_text().startswith("# Run report: run\n\n`ptbr finetune` — base, torch on cpu")


def test_report_command_rewrites_the_report_without_torch(resumed_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(resumed_run, copy)
    shutil.rmtree(copy / "plots")
    (copy / "report.md").unlink()
    # a skipped step and a memory peak in mid-run, as the loop would have written them (far above what a
    # tiny run's process holds on any machine, so it is the peak)
    rows = read_metrics(copy / "metrics.jsonl")
    rows[3]["loss"], rows[3]["grad_norm"], rows[4]["mem_bytes"] = None, None, 98_765_432_100
    (copy / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    script = textwrap.dedent(f"""
        import sys
        from ptbr.cli import main
        assert main(["report", {str(copy)!r}]) == 0
        loaded = [m for m in ("torch", "mlx") if m in sys.modules]
        assert not loaded, loaded
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [f"report: {copy / 'report.md'}", f"plots:  {copy / 'plots'}"]
    shown = table((copy / "report.md").read_text())
    assert shown["steps"] == "10 of 10" and shown["skipped steps"] == "1 (steps 4)"
    assert shown["peak memory"].startswith("measured 98,765,432,100 B (91.98 GiB); ")
    assert sorted(p.name for p in (copy / "plots").iterdir()) == sorted(f"{name}.png" for name in PLOTS)


def test_report_md_gives_the_times_of_a_run_not_yet_finished_where_monitor_gives_ages(resumed_run, tmp_path):
    """report.md took monitor's headline, "last activity 1 s ago", "written 1 s ago": stale as soon as
    the file was read later. It gives the time itself, in UTC; monitor's screen keeps the age."""
    import os
    import socket

    import psutil

    from ptbr.lock import LOCK_FILE
    from ptbr.monitor import assess, read_run
    from ptbr.report import numbers

    copy = tmp_path / "run"
    shutil.copytree(resumed_run, copy)
    (copy / "training_summary.json").unlink()
    lock = copy / LOCK_FILE
    lock.write_text(f"pid={os.getpid()}\nhost={socket.gethostname()}\n")
    since = int(time.time()) - 5  # taken by this live process (started before), which then wrote a step
    assert psutil.Process().create_time() <= since + 1
    os.utime(lock, (since, since))
    for name in ("metrics.jsonl", "train.log"):
        os.utime(copy / name, (since + 3, since + 3))
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(since + 3))
    where = f"PID {os.getpid()} on {socket.gethostname()}"
    assert numbers(read_run(copy))["status"] == f"running ({where}), training; last activity at {when} UTC"
    assert assess(read_run(copy), now=since + 9).headline == f"running ({where}), training; last activity 6 s ago"
    os.utime(lock, (1_699_999_000, 1_699_999_000))  # taken before this process started: its PID is another's now
    for name in ("metrics.jsonl", "train.log"):
        os.utime(copy / name, (1_700_000_000, 1_700_000_000))
    assert numbers(read_run(copy))["status"] == (f"dead: the run's process ({where}) is gone without a final summary; "
                                                 "last step 10 of 10, written at 2023-11-14 22:13:20 UTC")
    assert assess(read_run(copy), now=1_700_000_030).headline.endswith(", written 30 s ago")


def test_a_peak_just_over_the_prediction_is_not_rounded_down_to_it():
    """An MLX run 0.4% over its prediction showed "(100% of the prediction)" and "Measured/predicted: 1.00"."""
    from ptbr.report import _memory_text, _ratio

    over = {"peak_memory": 1_004_000_000, "predicted_peak": 1_000_000_000}
    assert _ratio(over) == " (100.4% of the prediction)" and _memory_text(over).endswith(" Measured/predicted: 1.004.")
    under = {"peak_memory": 950_000_000, "predicted_peak": 1_000_000_000}
    assert _ratio(under) == " (95% of the prediction)" and _memory_text(under).endswith(" Measured/predicted: 0.95.")
    assert [monitor.share_of(peak, 1_000_000) for peak in (1_000_040, 1_000_000, 999_996)] == ["100.004", "100", "100"]


def test_a_run_config_that_cannot_be_read_is_warned_of_in_the_report_as_in_monitor(resumed_run, tmp_path, capsys):
    """monitor warned "run_config.json cannot be read (JSONDecodeError)"; report.md printed "`ptbr ?` — ?, ?
    on ?, ?" and no warning (a finished run's report asks monitor for no status, nor its warnings)."""
    copy = tmp_path / "run"
    shutil.copytree(resumed_run, copy)
    (copy / "run_config.json").write_text('{"command": "train", "settings": {')
    assert main(["report", str(copy)]) == 0
    assert capsys.readouterr().err == f"warning: {copy}/run_config.json cannot be read (JSONDecodeError)\n"
    about, warning = (copy / "report.md").read_text().split("\n\n")[1:3]
    assert about.startswith("`ptbr ?` — ?, ? on ?, ?.")
    assert warning == "- warning: run_config.json cannot be read (JSONDecodeError)"


def test_several_runs_are_overlaid_in_one_report(resumed_run, tmp_path):
    second = tmp_path / "lr-high"
    assert train(second, "--max-steps", "5", "--learning-rate", "1e-2", "--eval-every", "5") == 0
    before = {p: p.stat().st_mtime_ns for p in [resumed_run / "report.md", second / "report.md"]}
    out = tmp_path / "comparison"
    shown = run_cli("report", str(resumed_run), str(second), "--output", str(out))
    assert shown.returncode == 0, shown.stderr
    report = (out / "report.md").read_text()
    first_rows, second_rows = read_metrics(resumed_run / "metrics.jsonl"), read_metrics(second / "metrics.jsonl")
    precision = json.loads((second / "run_config.json").read_text())["precision"]  # auto: bf16 or fp32 on CPU
    assert f"| run | tiny, torch on cpu, {precision} | 10 of 10 | {first_rows[-1]['loss']:.4f} |" in report
    assert f"| lr-high | tiny, torch on cpu, {precision} | 5 of 5 | {second_rows[-1]['loss']:.4f} |" in report
    for name in PLOTS:
        assert pixels_of(out / "plots" / f"{name}.png", SECOND_COLOR) > 100, f"{name}.png lacks the second run"
    assert {p: p.stat().st_mtime_ns for p in before} == before  # the runs' own reports are left alone


def test_wrong_requests_are_one_line_errors(resumed_run, tmp_path, capsys):
    assert main(["report", str(resumed_run), str(resumed_run)]) == 2
    assert capsys.readouterr().err.strip() == ("error: several runs need --output DIR for their comparison (ptbr "
                                               "report); fix: give --output DIR (report.md and plots/ are written there)")
    assert main(["report", str(tmp_path)]) == 2
    assert "not a ptbr run directory" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    assert main(["report", str(resumed_run), "--output", str(tmp_path / "afile")]) == 6
    assert capsys.readouterr().err.strip().endswith("; fix: a file stands where a directory goes: remove it, or "
                                                    "choose another output path")
    # --output never replaces what is not a report of ptbr's
    comparison = tmp_path / "comparison"
    assert main(["report", str(resumed_run), str(resumed_run / "."), "--output", str(comparison)]) == 2
    assert "the same run given twice" in capsys.readouterr().err
    assert main(["report", str(resumed_run), "--output", str(comparison)]) == 0  # a new folder
    assert main(["report", str(resumed_run), "--output", str(comparison)]) == 0  # its own report, again
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "report.md").write_text("# My thesis notes\n")
    other = tmp_path / "other-run"
    shutil.copytree(resumed_run, other)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.bin").write_bytes(b"")
    mine = tmp_path / "mine"
    (mine / "plots").mkdir(parents=True)
    (mine / "plots" / "figure1.png").write_bytes(b"")
    for folder, what in ((notes, "a report.md that ptbr did not write"), (other, "another training run's directory"),
                         (data, "holds a dataset (train.bin)"), (mine, "plots/figure1.png is not one of ptbr's plots")):
        capsys.readouterr()
        assert main(["report", str(resumed_run), "--output", str(folder)]) == 6, what
        assert what in capsys.readouterr().err
    assert (notes / "report.md").read_text() == "# My thesis notes\n" and (mine / "plots" / "figure1.png").exists()
    # inside a run (its plots/ took a report whose plots/plots/ then broke the run's own report for good),
    # or a model's folder
    for folder, what in ((other / "plots", f"--output is inside the run directory {other.resolve()}"),
                         (other / "checkpoints", "--output is inside the run directory"),
                         (other / "final", "--output is inside the run directory")):
        capsys.readouterr()
        assert main(["report", str(resumed_run), "--output", str(folder)]) == 6, what
        assert what in capsys.readouterr().err
    project = tmp_path / "project"  # a folder named checkpoints/ above --output is no run
    (project / "checkpoints").mkdir(parents=True)
    assert main(["report", str(resumed_run), "--output", str(project / "reports" / "r1")]) == 0
    assert main(["report", str(other), "--output", str(other)]) == 0  # a run's own directory, named
    model = tmp_path / "a-model"
    shutil.copytree(other / "final", model)
    assert main(["report", str(resumed_run), "--output", str(model)]) == 6
    assert "--output holds a model (model.safetensors)" in capsys.readouterr().err
    # a run's own report names what is in its way, and a fix that helps
    (other / "plots" / "plots").mkdir()
    assert main(["report", str(other)]) == 6
    assert capsys.readouterr().err.strip().endswith(
        f"the run directory's plots/plots is not one of ptbr's plots: plots/ would be replaced ({other}); fix: move "
        f"{other / 'plots' / 'plots'} aside, or give --output a folder of its own")
    starting = tmp_path / "starting"
    starting.mkdir()
    (starting / "train.log").write_text("2026-01-01 00:00:00 backend torch, device cpu\n")
    assert main(["report", str(starting)]) == 3
    assert capsys.readouterr().err.strip().startswith("error: no metrics to report yet: ")


def test_without_matplotlib_the_report_is_a_one_line_error_and_a_run_still_succeeds(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the report extra were not installed
    out = tmp_path / "run"
    assert train(out, "--max-steps", "2") == 0
    log = (out / "train.log").read_text()
    assert f"no report: matplotlib is not installed; pip install 'ptbr[report]', then `ptbr report {out}`" in log
    assert not (out / "report.md").exists() and not (out / "plots").exists()
    capsys.readouterr()
    assert main(["report", str(out)]) == 2
    assert capsys.readouterr().err.strip() == ("error: plots need matplotlib, which is not installed (ptbr report); "
                                               "fix: pip install 'ptbr[report]'")
    # inside ptbr's image pip cannot add it (root-owned, no network): the host can
    monkeypatch.setenv("PTBR_IMAGE_VARIANT", "cpu")
    assert main(["report", str(out)]) == 2
    assert capsys.readouterr().err.strip().endswith("fix: the ptbr-cpu image leaves out the report extra: run "
                                                    "`ptbr report` on the host, on the run directory in the /out volume")


def test_a_report_that_fails_never_fails_the_finished_run(tmp_path, monkeypatch):
    import errno

    from matplotlib.figure import Figure

    def disk_full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    out = tmp_path / "run"
    assert train(out, "--max-steps", "2") == 0
    assert (out / "final").is_dir() and (out / "training_summary.json").is_file()
    log = (out / "train.log").read_text()
    assert ("warning: the run report was not written (error: the disk filled up (or a file size limit or quota was "
            "hit) while writing the report's plots: ") in log
    assert f"the run's results are saved: `ptbr report {out}` tries again" in log
    assert log.strip().splitlines()[-1].split(" ", 2)[2].startswith("done: 2 steps")
    assert not (out / "plots").exists() and not list(out.glob(".tmp-*"))


def test_a_full_disk_while_writing_the_report_is_exit_6_and_keeps_the_previous(resumed_run, tmp_path):
    import resource

    copy = tmp_path / "copy"
    shutil.copytree(resumed_run, copy)
    before = {name: (copy / "plots" / f"{name}.png").read_bytes() for name in PLOTS}

    def limit_files():  # any file over 4 KB fails to write: every plot does
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))

    run = subprocess.run([sys.executable, "-m", "ptbr", "report", str(copy)], capture_output=True, text=True,
                         timeout=120, preexec_fn=limit_files, cwd=REPO)
    assert run.returncode == 6, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(
        "error: the disk filled up (or a file size limit or quota was hit) while writing the report's plots")
    assert {name: (copy / "plots" / f"{name}.png").read_bytes() for name in PLOTS} == before
    assert not list(copy.glob(".tmp-*"))


# ---- --tensorboard ---------------------------------------------------------------------------


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


CRC32C = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C (Castagnoli), rotated and offset."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def events(path: Path) -> list:
    """The Event records of a TensorBoard event file, each length and payload checksum verified."""
    from tensorboardX.proto.event_pb2 import Event

    data, at, found = path.read_bytes(), 0, []
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[at + 8:at + 12])[0] == masked_crc32c(header)
        payload = data[at + 12:at + 12 + length]
        assert struct.unpack("<I", data[at + 12 + length:at + 16 + length])[0] == masked_crc32c(payload)
        found.append(Event.FromString(payload))
        at += 16 + length
    return found


def test_tensorboard_events_hold_the_numbers_of_metrics_jsonl(resumed_run):
    import numpy as np

    pytest.importorskip("tensorboardX", reason="the tensorboard extra: pip install 'ptbr[tensorboard]'")
    files = sorted((resumed_run / "tensorboard").iterdir())
    assert len(files) == 2 and all(".out.tfevents." in f.name for f in files)  # one per session
    first, second = (events(f) for f in files)
    assert first[0].file_version == second[0].file_version == "brain.Event:2"
    # the resumed session tells TensorBoard to drop what the first wrote after the checkpoint
    assert second[1].step == 7 and second[1].session_log.status == second[1].session_log.START
    written = {}
    for event in first[1:] + second[2:]:
        written[event.step] = {value.tag: value.simple_value for value in event.summary.value}
    rows = read_metrics(resumed_run / "metrics.jsonl")
    assert sorted(written) == [r["step"] for r in rows] == list(range(1, 11))
    for row in rows:
        expected = {name: np.float32(row[name]) for name in SCALARS if row[name] is not None}
        assert written[row["step"]] == expected, row["step"]  # TensorBoard keeps 32-bit floats
    assert "val_loss" in written[3] and "val_loss" not in written[4]


def test_tensorboard_without_its_extra_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    out = tmp_path / "run"
    assert train(out, "--max-steps", "2", "--tensorboard") == 2
    assert capsys.readouterr().err.strip() == ("error: --tensorboard needs tensorboardX, which is not installed "
                                               "(--tensorboard); fix: pip install 'ptbr[tensorboard]', or leave out "
                                               "--tensorboard")
    assert not out.exists()
    monkeypatch.setenv("PTBR_IMAGE_VARIANT", "cuda")
    assert train(out, "--max-steps", "2", "--tensorboard") == 2
    assert capsys.readouterr().err.strip().endswith("fix: the ptbr-cuda image leaves out the tensorboard extra: leave "
                                                    "out --tensorboard (metrics.jsonl holds the same numbers; ptbr "
                                                    "monitor and ptbr report read it)")
