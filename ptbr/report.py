"""`ptbr report`: plots (loss, learning rate, memory, throughput) and report.md from a run
directory, or from several runs with their curves overlaid. A run also writes its own report
when it finishes (ptbr.runs.common.finish), where matplotlib is installed.

matplotlib is the `report` extra: it is imported only here, when plots are drawn, through its
object API (Figure and the Agg canvas), so that no process-wide backend is switched.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

from ptbr import __version__
from ptbr.errors import ConfigError, DataError, OutputError
from ptbr.files import write_directory, write_text, writing
from ptbr.monitor import (
    Run,
    assess,
    format_bytes,
    peak_memory,
    perplexity,
    read_run,
    share_of,
    smoothed,
)
from ptbr.train.progress import format_eta
from ptbr.versions import install_extra

PLOT_INCHES = (8.0, 4.5)
PLOT_DPI = 100  # 800 x 450 pixels
PLOTS = {  # file name (without .png) -> what it shows, for report.md
    "loss": "Training loss (raw and smoothed) and validation loss",
    "learning_rate": "Learning rate",
    "memory_usage": "Peak memory so far against the memory model's predicted peak",
    "throughput": "Throughput (tokens/s)",
}


def matplotlib_installed() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def require_matplotlib() -> None:
    if not matplotlib_installed():
        raise ConfigError("plots need matplotlib, which is not installed", "ptbr report", install_extra(
            "report", "run `ptbr report` on the host, on the run directory in the /out volume"))


def write_report(run_dirs: list[str | Path], output: str | Path | None = None) -> Path:
    """OUTPUT/plots/*.png and OUTPUT/report.md for one run (OUTPUT: the run directory unless
    `output` is given), or for several runs overlaid (then `output` is required). Returns the
    path of report.md."""
    runs = [read_run(d) for d in run_dirs]
    empty = [str(run.run_dir) for run in runs if not run.rows]
    if empty:
        raise DataError(f"no metrics to report yet: {', '.join(empty)} has no metrics.jsonl row", empty[0],
                        "wait for the run's first step, or check the path")
    if output is None and len(runs) > 1:
        raise ConfigError("several runs need --output DIR for their comparison", "ptbr report",
                          "give --output DIR (report.md and plots/ are written there)")
    resolved = [run.run_dir.resolve() for run in runs]
    if len(set(resolved)) < len(resolved):
        twice = next(run.run_dir for run, path in zip(runs, resolved, strict=True) if resolved.count(path) > 1)
        raise ConfigError(f"the same run given twice: {twice}", "ptbr report", "name each run once")
    require_matplotlib()
    for run in runs:  # what monitor warns of: a run_config.json that cannot be read leaves the report's "?"s
        for problem in run.problems:
            print(f"warning: {run.run_dir / problem}", file=sys.stderr, flush=True)
    folder = Path(output).expanduser() if output is not None else runs[0].run_dir
    check_report_folder(folder, runs, given=output is not None)
    with writing("the report", folder):
        folder.mkdir(parents=True, exist_ok=True)
    names = run_names(runs)
    write_directory(folder / "plots", lambda tmp: draw_plots(runs, names, tmp), "the report's plots")
    text = single_report(runs[0]) if len(runs) == 1 else comparison_report(runs, names)
    return write_text(folder / "report.md", text, "report.md")


def check_report_folder(folder: Path, runs: list[Run], given: bool = True) -> None:
    """Where report.md and plots/ go: a run's own report goes into its directory; any other folder
    may be new or hold an earlier report of ptbr's, never a dataset, a model, another run, a folder
    inside a run (its plots/, checkpoints/, final/: the run's own report would then find a foreign
    plots/plots/ there), or a user's files that the report would replace (plots/ is replaced whole)."""
    from ptbr.data.prepare import RUN_MARKERS
    from ptbr.data.tokens import dataset_files_in
    from ptbr.outputs import enclosing_run, model_files_in

    fix = "give --output a folder of its own (e.g. reports/NAME), or leave it out for one run's own report"
    # a run's own directory is where its report goes (also a run set aside in previous/); above it,
    # a run is known by the files only a run writes (a folder named checkpoints/ is anyone's)
    inside = given and folder.resolve() not in {run.run_dir.resolve() for run in runs} and enclosing_run(folder)
    if inside:
        raise OutputError(f"--output is inside the run directory {inside}: the report would mix with that run's files",
                          str(folder), fix)
    if not folder.is_dir():
        return  # new (or a file, which writing the report refuses)
    where = "--output" if given else "the run directory"
    dataset = dataset_files_in(folder)
    if dataset:
        raise OutputError(f"--output holds a dataset ({dataset[0]})", str(folder), fix)
    model = model_files_in(folder)
    if model:
        raise OutputError(f"--output holds a model ({model[0]})", str(folder), fix)
    own = len(runs) == 1 and folder.resolve() == runs[0].run_dir.resolve()
    if not own and any((folder / name).exists() for name in RUN_MARKERS):
        raise OutputError("--output is another training run's directory: its own report would be replaced",
                          str(folder), fix)
    report = folder / "report.md"
    if report.exists() and not (report.is_file() and _written_by_ptbr(report)):
        raise OutputError(f"{where} holds a report.md that ptbr did not write: it would be replaced", str(folder),
                          fix if given else "move that report.md aside, or give --output a folder of its own")
    plots = folder / "plots"
    theirs = sorted(p.name for p in plots.iterdir() if p.name not in {f"{n}.png" for n in PLOTS}) if plots.is_dir() else []
    if theirs or (plots.exists() and not plots.is_dir()):
        raise OutputError(f"{where}'s plots{'/' + theirs[0] if theirs else ''} is not one of ptbr's plots: "
                          "plots/ would be replaced", str(folder),
                          fix if given else f"move {plots / theirs[0] if theirs else plots} aside, or give --output a "
                          "folder of its own")


def _written_by_ptbr(report: Path) -> bool:
    with open(report, encoding="utf-8", errors="replace") as f:
        return f.readline().startswith(("# Run report: ", "# Run comparison"))


def run_names(runs: list[Run]) -> list[str]:
    """Short names for a legend: the folder names, or the paths below their common folder."""
    names = [run.run_dir.name for run in runs]
    if len(set(names)) == len(names):
        return names
    paths = [str(run.run_dir.resolve()) for run in runs]
    common = os.path.commonpath(paths)
    return [os.path.relpath(p, common) if p != common else run.run_dir.name for p, run in zip(paths, runs, strict=True)]


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def draw_plots(runs: list[Run], names: list[str], folder: Path) -> None:
    """Write PLOTS into `folder` as PNG files of PLOT_INCHES at PLOT_DPI."""
    from matplotlib.figure import Figure

    several = len(runs) > 1

    def figure(title: str, ylabel: str):
        fig = Figure(figsize=PLOT_INCHES, dpi=PLOT_DPI)
        ax = fig.subplots()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        return fig, ax

    def save(fig, ax, name: str) -> None:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(folder / f"{name}.png", dpi=PLOT_DPI)

    fig, ax = figure("Loss", "loss")
    for index, (run, name) in enumerate(zip(runs, names, strict=True)):
        color = f"C{index}"
        prefix = f"{name}: " if several else ""
        steps, losses = _series(run, "loss")
        if steps:
            ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(steps, smoothed(losses), color=color, linewidth=1.6, label=f"{prefix}train (smoothed)")
        steps, val = _series(run, "val_loss")
        if steps:
            ax.plot(steps, val, color=color, linestyle="--", marker="o", markersize=3, label=f"{prefix}validation")
    save(fig, ax, "loss")

    fig, ax = figure("Learning rate", "learning rate")
    for index, (run, name) in enumerate(zip(runs, names, strict=True)):
        steps, lr = _series(run, "lr")
        ax.plot(steps, lr, color=f"C{index}", label=name if several else None)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    save(fig, ax, "learning_rate")

    peaks = [max(_series(run, "mem_bytes")[1] or [0]) for run in runs] + [run.predicted_peak or 0 for run in runs]
    unit, scale = ("GiB", 1024**3) if max(peaks) >= 1024**3 else ("MiB", 1024**2)
    fig, ax = figure("Peak memory so far", unit)
    for index, (run, name) in enumerate(zip(runs, names, strict=True)):
        prefix = f"{name}: " if several else ""
        steps, memory = _series(run, "mem_bytes")  # each row: its process's peak so far (monitor.peak_memory)
        ax.plot(steps, [m / scale for m in memory], color=f"C{index}", label=f"{prefix}measured peak")
        if run.predicted_peak:
            ax.axhline(run.predicted_peak / scale, color=f"C{index}", linestyle="--",
                       label=f"{prefix}predicted peak")
    ax.set_ylim(0, 1.1 * max(peaks) / scale)
    save(fig, ax, "memory_usage")

    fig, ax = figure("Throughput", "tokens/s")
    for index, (run, name) in enumerate(zip(runs, names, strict=True)):
        steps, speed = _series(run, "tokens_per_s")
        if steps:
            ax.plot(steps, speed, color=f"C{index}", alpha=0.25, linewidth=0.8)
            ax.plot(steps, smoothed(speed), color=f"C{index}", linewidth=1.6,
                    label=f"{name} (smoothed)" if several else "smoothed")
    ax.set_ylim(bottom=0)
    save(fig, ax, "throughput")


def _series(run: Run, column: str) -> tuple[list[int], list[float]]:
    pairs = [(row["step"], row[column]) for row in run.rows if isinstance(row.get(column), (int, float))]
    return [s for s, _ in pairs], [v for _, v in pairs]


# --------------------------------------------------------------------------------------------
# report.md
# --------------------------------------------------------------------------------------------


def numbers(run: Run) -> dict:
    """The summary's numbers, from metrics.jsonl (and run_config.json, training_summary.json)."""
    _, losses = _series(run, "loss")
    evals = [(row["step"], row["val_loss"]) for row in run.rows if row.get("val_loss") is not None]
    _, speeds = _series(run, "tokens_per_s")
    peak = peak_memory(run.rows)
    last = run.rows[-1]
    return {
        # a run writes its report after its summary, while it still holds its lock: finished; times,
        # not ages ("last activity 1 s ago"), in a file read later
        "status": "finished" if run.summary_is_current else assess(run, absolute=True).headline,
        "steps": run.step,
        "total_steps": run.total_steps,
        "tokens_seen": (run.summary or {}).get("tokens_seen") if run.summary_is_current else None,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "smoothed_loss": smoothed(losses)[-1] if losses else None,
        "final_val": evals[-1] if evals else None,
        "best_val": min(evals, key=lambda e: e[1]) if evals else None,
        "elapsed_s": last.get("elapsed_s"),
        "tokens_per_s": statistics.median(speeds) if speeds else None,
        "peak_memory": peak[1] if peak else None,
        "predicted_peak": run.predicted_peak,
        "skipped": run.skipped_steps(),
        "resumes": run.resumes(),
    }


def single_report(run: Run) -> str:
    n = numbers(run)
    lines = [f"# Run report: {run.run_dir.name}", "", _about(run), ""]
    lines += [f"- warning: {problem}" for problem in run.problems] + [""] * bool(run.problems)
    lines += ["## Summary", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in _summary_rows(n)]
    lines += ["", "## Plots", ""]
    lines += [f"![{text}](plots/{name}.png)\n" for name, text in PLOTS.items()]
    lines += ["## Memory", "", _memory_text(n), "", "## Settings", "", "| setting | value |", "|---|---|"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in run.settings.items()]
    versions = run.config.get("versions")
    if isinstance(versions, dict):
        lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v) + "."]
    return "\n".join(lines) + "\n"


def comparison_report(runs: list[Run], names: list[str]) -> str:
    lines = ["# Run comparison", "", f"Written {_now()} by ptbr {__version__}.", "",
             "| run | what | steps | final loss | best val_loss | tokens/s | peak memory | predicted peak |",
             "|---|---|---|---|---|---|---|---|"]
    for run, name in zip(runs, names, strict=True):
        n = numbers(run)
        best = n["best_val"]
        lines.append(" | ".join([
            f"| {name}", _describe(run), _steps(n), _loss(n["final_loss"]),
            f"{best[1]:.4f} (step {best[0]})" if best else "-",
            f"{n['tokens_per_s']:,.0f}" if n["tokens_per_s"] else "-",
            _bytes(n["peak_memory"]), _bytes(n["predicted_peak"]) + " |"]))
    lines += ["", "Runs:", ""] + [f"- {name}: `{run.run_dir}`" for run, name in zip(runs, names, strict=True)]
    lines += [f"- warning: {name}: {problem}" for run, name in zip(runs, names, strict=True) for problem in run.problems]
    lines += ["", "## Plots", ""] + [f"![{text}](plots/{name}.png)\n" for name, text in PLOTS.items()]
    return "\n".join(lines) + "\n"


def _about(run: Run) -> str:
    config = run.config
    parts = [f"`ptbr {config.get('command', '?')}`", _describe(run)]
    model = config.get("model")
    if isinstance(model, dict) and isinstance(model.get("parameters"), int):
        parts.append(f"{model['parameters']:,} parameters")
    if isinstance(config.get("trainable_parameters"), int):
        parts.append(f"{config['trainable_parameters']:,} trainable of {config.get('total_parameters', 0):,} "
                     "parameters")
    if config.get("data") or config.get("train"):
        parts.append(f"data `{config.get('data') or config.get('train')}`")
    return " — ".join(parts) + f". Written {_now()} by ptbr {__version__} from `{run.run_dir}`."


def _describe(run: Run) -> str:
    settings = run.settings
    what = settings.get("model_size") or Path(str(settings.get("base") or "?")).name
    config = run.config
    return f"{what}, {config.get('backend', '?')} on {config.get('device', '?')}, {config.get('precision', '?')}"


def _summary_rows(n: dict) -> list[tuple[str, str]]:
    rows = [("status", n["status"]), ("steps", _steps(n))]
    if n["tokens_seen"] is not None:
        rows.append(("tokens seen", f"{n['tokens_seen']:,}"))
    rows.append(("train loss", f"first {_loss(n['first_loss'])}, final {_loss(n['final_loss'])}, "
                               f"smoothed {_loss(n['smoothed_loss'])}"))
    if n["final_val"]:
        (step, val), (best_step, best) = n["final_val"], n["best_val"]
        rows.append(("validation loss", f"final {val:.4f} at step {step} (perplexity {perplexity(val):.2f}); "
                                        f"best {best:.4f} at step {best_step} (perplexity {perplexity(best):.2f})"))
    if isinstance(n["elapsed_s"], (int, float)):
        rows.append(("training time", f"{format_eta(n['elapsed_s'])} ({n['elapsed_s']:.1f} s)"))
    if n["tokens_per_s"]:
        rows.append(("throughput", f"{n['tokens_per_s']:,.1f} tokens/s (median over the steps)"))
    rows.append(("peak memory", f"measured {_bytes(n['peak_memory'], exact=True)}; predicted "
                                f"{_bytes(n['predicted_peak'], exact=True)}" + _ratio(n)))
    skipped = n["skipped"]
    rows.append(("skipped steps", f"{len(skipped)}" + (f" (steps {', '.join(map(str, skipped[:20]))}"
                                                       + (" ..." if len(skipped) > 20 else "") + ")" if skipped else "")))
    resumes = n["resumes"]
    rows.append(("resumes", "none" if not resumes else f"{len(resumes)}: " + "; ".join(
        (f"{when} " if when else "") + (f"from step {step} " if step >= 0 else "") + f"(`{path}`)"
        for when, step, path in resumes)))
    return rows


def _memory_text(n: dict) -> str:
    text = ("Measured: the largest `mem_bytes` of metrics.jsonl, where each row holds the peak the run's "
            "process had reached by that step, not the memory in use then (torch: on a GPU the "
            "allocator's peak, `torch.cuda.max_memory_allocated`; on the CPU the process's peak resident "
            "memory, the interpreter, libraries and data loading included; MLX: its allocator's peak "
            "since the training step was built, without the interpreter around it). Predicted: the "
            "memory model's peak for the run's settings (`ptbr info`, `ptbr preflight`) of that same "
            "figure, recorded in run_config.json when the run started.")
    if n["peak_memory"] and n["predicted_peak"]:
        text += f" Measured/predicted: {share_of(n['peak_memory'], n['predicted_peak'], scale=1, decimals=2)}."
    return text


def _ratio(n: dict) -> str:
    if n["peak_memory"] and n["predicted_peak"]:
        return f" ({share_of(n['peak_memory'], n['predicted_peak'])}% of the prediction)"
    return ""


def _steps(n: dict) -> str:
    return f"{n['steps']} of {n['total_steps']}" if n["total_steps"] else f"{n['steps']}"


def _loss(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else "-"


def _bytes(value: int | None, exact: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:,} B ({format_bytes(value)})" if exact else format_bytes(value)


def _cell(value) -> str:
    return str(value).replace("|", "\\|")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
