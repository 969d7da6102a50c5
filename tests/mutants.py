"""Mutation testing of the training core: one small deliberate bug at a time, each of which the
tests must notice. `nox -s mutants` runs it; a periodic check, not CI.

Each mutant is applied to a temporary copy of this checkout (never to the checkout itself), then
the module's tests run there with -x; the mutant is killed when they fail (or time out). Two kinds:
generated mutants (comparison flips, + and - swapped, changed constants, removed calls, `and`/`or`
swapped, returns of None, ...) over the TARGETS below, sampled with --max/--seed; and CURATED ones,
the bugs a review once found the tests let through, always run so that the report shows they stay
killed. The score, the survivors (file:line and the change) and a JSON report come out at the end.

    python tests/mutants.py --max 40 --seed 0            # a sample; the full set takes hours
    python tests/mutants.py --module ptbr/backends/torch/step.py  # every mutant of one module
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from queue import Queue

REPO = Path(__file__).resolve().parents[1]

# --- what is mutated, and which tests must catch it (keep this table up to date) ----------------
# Module -> its test files, fastest and most direct first (pytest stops at the first failure).
TARGETS: dict[str, tuple[str, ...]] = {
    "ptbr/backends/torch/step.py": ("tests/test_mutation_guards.py", "tests/test_training.py"),
    "ptbr/backends/torch/loss.py": ("tests/test_loss.py", "tests/test_mutation_guards.py"),
    "ptbr/train/loop.py": ("tests/test_mutation_guards.py", "tests/test_training.py"),
    "ptbr/train/checkpoint.py": ("tests/test_mutation_guards.py", "tests/test_training.py"),
    "ptbr/train/schedule.py": ("tests/test_schedule.py", "tests/test_training.py"),
    "ptbr/data/batch.py": ("tests/test_mutation_guards.py", "tests/test_training.py"),
    "ptbr/data/tokens.py": ("tests/test_mutation_guards.py", "tests/test_data.py", "tests/test_training.py"),
    "ptbr/finetune/batches.py": ("tests/test_mutation_guards.py", "tests/test_chat_data.py"),
}
# Added with --thorough: end-to-end files that take minutes per mutant (subprocess runs, fine-tuning,
# resuming, data parallelism over gloo).
THOROUGH: dict[str, tuple[str, ...]] = {
    "ptbr/backends/torch/step.py": ("tests/test_finetune.py", "tests/test_robustness.py", "tests/test_resume.py",
                                    "tests/test_parallel.py"),
    "ptbr/train/loop.py": ("tests/test_robustness.py", "tests/test_finetune.py", "tests/test_resume.py",
                           "tests/test_parallel.py"),
    "ptbr/train/checkpoint.py": ("tests/test_resume.py", "tests/test_robustness.py"),
    "ptbr/data/batch.py": ("tests/test_finetune.py",),
    "ptbr/data/tokens.py": ("tests/test_robustness.py", "tests/test_parallel.py"),
    "ptbr/finetune/batches.py": ("tests/test_finetune.py", "tests/test_parallel.py"),
}
# Bugs once missed or caught only by chance (issue 10). `find` must occur exactly once in `module`;
# when the code moves, update find/replace here (the report marks a stale entry "not applicable").
CURATED: list[dict[str, str]] = [
    {"name": "a non-finite step applied instead of skipped", "module": "ptbr/backends/torch/step.py",
     "find": "elif not skipped:\n            self.optimizer.step()",
     "replace": "else:\n            self.optimizer.step()"},
    {"name": "validation loss averaged per batch, not per target token", "module": "ptbr/backends/torch/step.py",
     "find": "total += self._loss_sum(self.model, self._to_device(batch)).item()\n"
             "                count += target_count(batch)",
     "replace": "total += self._loss_sum(self.model, self._to_device(batch)).item() / max(1, target_count(batch))\n"
                "                count += 1"},
    {"name": "RandomWindows' check of a token file shorter than one window removed", "module": "ptbr/data/tokens.py",
     "find": "if len(tokens) < seq_len + 1:", "replace": "if False:"},
    {"name": "accumulation as a mean of per-micro-batch means", "module": "ptbr/backends/torch/step.py",
     "find": "self.scaler.scale(loss_sum * self.world.size / targets).backward()",
     "replace": "self.scaler.scale(loss_sum * self.world.size / max(1, target_count(batch)) / len(micro_batches))"
                ".backward()"},
    {"name": "gradient clipping removed", "module": "ptbr/backends/torch/step.py",
     "find": "clip = self.max_grad_norm if self.max_grad_norm > 0 else math.inf", "replace": "clip = math.inf"},
    {"name": "the torch RNG not restored on resume", "module": "ptbr/backends/torch/step.py",
     "find": "torch.set_rng_state(by_rank[self.world.rank])", "replace": "pass"},
    {"name": "a stateful batch RNG (pretraining windows)", "module": "ptbr/data/tokens.py",
     "find": "rng = np.random.default_rng([self.seed, index])",
     "replace": 'rng = self.__dict__.setdefault("_rng", np.random.default_rng([self.seed, index]))'},
    {"name": "a stateful batch RNG (fine-tuning epochs)", "module": "ptbr/finetune/batches.py",
     "find": "return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))",
     "replace": 'return self.__dict__.setdefault("_rng", np.random.default_rng([self.seed, epoch]))'
                ".permutation(len(self.examples))"},
]
# Calls whose removal changes only what is printed; the messages have tests of their own.
QUIET_CALLS = {"log"}
RESULTS = REPO / "runs" / "mutants"


@dataclass
class Mutant:
    module: str
    line: int
    col: int
    operator: str
    original: str  # the source text replaced
    mutated: str  # what replaced it
    line_before: str = ""  # the first changed line, before and after (what the report shows)
    line_after: str = ""
    start: tuple[int, int] = field(repr=False, default=(0, 0))  # (line, col) of the replaced text
    end: tuple[int, int] = field(repr=False, default=(0, 0))
    name: str | None = None  # curated mutants: the bug, in words

    def apply(self, source: str) -> str:
        if self.name is not None:
            return source.replace(self.original, self.mutated, 1)
        lines = source.splitlines(keepends=True)
        offsets = [0]
        for line in lines:
            offsets.append(offsets[-1] + len(line.encode("utf-8")))
        data = source.encode("utf-8")
        start = offsets[self.start[0] - 1] + self.start[1]
        end = offsets[self.end[0] - 1] + self.end[1]
        return (data[:start] + self.mutated.encode("utf-8") + data[end:]).decode("utf-8")


@dataclass
class Outcome:
    mutant: Mutant
    status: str  # killed | survived | timeout | error (the tests could not even start) | not applicable
    seconds: float
    killed_by: str | None = None


# --- generating mutants ---------------------------------------------------------------------------

COMPARE_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                 ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
ARITH_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
               ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult}


class _Finder(ast.NodeVisitor):
    """Collects (node, operator, replacement text) for every mutation site of one module."""

    def __init__(self, source: str):
        self.source = source
        self.found: list[tuple[ast.AST, str, str]] = []

    def add(self, node: ast.AST, operator: str, replacement: ast.AST | str) -> None:
        text = replacement if isinstance(replacement, str) else f"({ast.unparse(replacement)})"
        self.found.append((node, operator, text))

    def generic_visit(self, node):
        # not inside strings, docstrings and messages, nor in annotations (they do not run)
        if isinstance(node, ast.JoinedStr):
            return
        for name, value in ast.iter_fields(node):
            if name in ("annotation", "returns"):
                continue
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    self.visit(child)

    def visit_Expr(self, node: ast.Expr):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # a docstring
        call = node.value
        if isinstance(call, ast.Call) and _called_name(call) in QUIET_CALLS:
            return
        if isinstance(call, ast.Call):
            self.add(node, "call removed", "pass")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in COMPARE_SWAPS:
                ops = list(node.ops)
                ops[i] = COMPARE_SWAPS[type(op)]()
                self.add(node, "comparison flipped", ast.Compare(node.left, ops, node.comparators))
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp):
        if type(node.op) in ARITH_SWAPS:
            self.add(node, "arithmetic swapped", ast.BinOp(node.left, ARITH_SWAPS[type(node.op)](), node.right))
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign):
        self.add(node, "statement removed", "pass")
        if type(node.op) in ARITH_SWAPS:
            swapped = ast.AugAssign(node.target, ARITH_SWAPS[type(node.op)](), node.value)
            self.add(node, "arithmetic swapped", ast.unparse(swapped))
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp):
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        self.add(node, "and/or swapped", ast.BoolOp(other, node.values))
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp):
        if isinstance(node.op, ast.Not):
            self.add(node, "not removed", node.operand)
        self.generic_visit(node)

    def visit_If(self, node: ast.If):
        if not isinstance(node.test, (ast.Compare, ast.UnaryOp)):  # those have their own flips
            self.add(node.test, "condition negated", ast.UnaryOp(ast.Not(), node.test))
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return):
        if node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            self.add(node.value, "return value replaced by None", "None")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call):
        if _called_name(node) in QUIET_CALLS:
            return
        if isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
            self.add(node.func, "min/max swapped", "max" if node.func.id == "min" else "min")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant):
        value = node.value
        if isinstance(value, bool):
            self.add(node, "constant changed", repr(not value))
        elif isinstance(value, int):
            self.add(node, "constant changed", repr(value + 1))
        elif isinstance(value, float):
            self.add(node, "constant changed", repr(value * 2 if value else 1.0))


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def generate(module: str) -> list[Mutant]:
    """Every generated mutant of `module` that still compiles and changes the program."""
    source = (REPO / module).read_text(encoding="utf-8")
    tree = ast.parse(source)
    finder = _Finder(source)
    finder.visit(tree)
    original_dump = ast.dump(tree)
    mutants, seen = [], set()
    for node, operator, text in finder.found:
        mutant = Mutant(module, node.lineno, node.col_offset, operator, ast.get_source_segment(source, node) or "",
                        text, start=(node.lineno, node.col_offset), end=(node.end_lineno, node.end_col_offset))
        mutated = mutant.apply(source)
        mutant.line_before = source.splitlines()[node.lineno - 1].strip()
        mutant.line_after = mutated.splitlines()[node.lineno - 1].strip()
        try:
            dump = ast.dump(ast.parse(mutated))
        except SyntaxError:
            continue
        if dump == original_dump or dump in seen:
            continue
        seen.add(dump)
        mutants.append(mutant)
    return mutants


def curated(modules: list[str]) -> tuple[list[Mutant], list[Outcome]]:
    """The curated mutants of `modules`; a stale entry (its text is gone) comes back as an outcome."""
    ready, stale = [], []
    for entry in CURATED:
        if entry["module"] not in modules:
            continue
        source = (REPO / entry["module"]).read_text(encoding="utf-8")
        line = source[:max(0, source.find(entry["find"]))].count("\n") + 1
        mutant = Mutant(entry["module"], line, 0, "curated", entry["find"], entry["replace"],
                        " ".join(entry["find"].split()), " ".join(entry["replace"].split()), name=entry["name"])
        if source.count(entry["find"]) != 1:
            stale.append(Outcome(mutant, "not applicable", 0.0, "the text to replace is not in the module once: "
                                 "update CURATED in tests/mutants.py"))
        else:
            ready.append(mutant)
    return ready, stale


# --- running --------------------------------------------------------------------------------------


def checkout_files() -> list[str]:
    """The working tree as git sees it (tracked and new files, not ignored ones)."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                                capture_output=True, check=True).stdout.decode()
        return [name for name in listed.split("\0") if name and (REPO / name).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: the package and its tests
        return [str(p.relative_to(REPO)) for folder in ("ptbr", "tests") for p in (REPO / folder).rglob("*")
                if p.is_file() and "__pycache__" not in p.parts] + ["pyproject.toml"]


def make_copy(files: list[str], parent: Path) -> Path:
    root = Path(tempfile.mkdtemp(prefix="copy-", dir=parent))
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    return root


def environment(root: Path) -> dict[str, str]:
    # no bytecode: a mutant of the same size written within the same second as the last one could
    # otherwise run from a stale .pyc
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                PYTHONDONTWRITEBYTECODE="1")


def check_copy_is_imported(root: Path) -> None:
    where = subprocess.run([sys.executable, "-c", "import ptbr; print(ptbr.__file__)"], cwd=root,
                           env=environment(root), capture_output=True, text=True).stdout.strip()
    if not where.startswith(str(root)):
        raise SystemExit(f"mutants: `import ptbr` in the copy loads {where}, not the copy; run from a checkout")


def run_tests(root: Path, tests: tuple[str, ...], marker: str | None, timeout: float) -> tuple[str, float, str | None]:
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE", *tests]
    if marker:
        command += ["-m", marker]
    started = time.monotonic()
    # a session of its own: a hang is ended with every process the tests started (CLI subprocesses)
    run = subprocess.Popen(command, cwd=root, env=environment(root), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        run.communicate()
        return "timeout", time.monotonic() - started, None
    seconds = time.monotonic() - started
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    if run.returncode == 0:
        return "survived", seconds, None
    if run.returncode == 1:
        return "killed", seconds, failed.group(1) if failed else None
    # 2: interrupted or a collection error (the mutant broke an import), 3/4: internal or usage error
    last = output.strip().splitlines()[-1:]
    return "error", seconds, failed.group(1) if failed else (last[0] if last else f"pytest exit {run.returncode}")


def tests_for(module: str, thorough: bool) -> tuple[str, ...]:
    return TARGETS[module] + (THOROUGH.get(module, ()) if thorough else ())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--max", type=int, default=None, help="run at most N generated mutants, sampled at random")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample")
    parser.add_argument("--module", action="append", choices=sorted(TARGETS),
                        help="mutate only this module (repeatable; default: all of TARGETS)")
    parser.add_argument("--curated-only", action="store_true", help="only the curated mutants")
    parser.add_argument("--no-curated", action="store_true", help="only generated mutants")
    parser.add_argument("--thorough", action="store_true",
                        help="also the end-to-end tests of THOROUGH and those marked slow (minutes per mutant)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants tested at once, each in its own copy")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per mutant before it counts as killed by a hang (default: 3x the clean run + 60)")
    parser.add_argument("--list", action="store_true", help="list the mutants that would run, and stop")
    parser.add_argument("--report", type=Path, default=RESULTS / "report.json", help="where the JSON report goes")
    args = parser.parse_args(argv)

    modules = args.module or list(TARGETS)
    generated = [] if args.curated_only else [m for module in modules for m in generate(module)]
    available = len(generated)
    if args.max is not None and args.max < len(generated):
        generated = sorted(random.Random(args.seed).sample(generated, args.max),
                           key=lambda m: (m.module, m.start))
    chosen, stale = ([], []) if args.no_curated else curated(modules)
    chosen += generated
    print(f"mutants: {available} generated over {len(modules)} module(s), running {len(generated)}"
          f"{' (seed ' + str(args.seed) + ')' if args.max is not None else ''}"
          f" + {len(chosen) - len(generated)} curated", flush=True)
    if args.list:
        for mutant in chosen:
            print(f"  {describe(mutant)}")
        return 0

    marker = None if args.thorough else "not slow"
    scratch = Path(tempfile.mkdtemp(prefix="ptbr-mutants-"))
    try:
        files = checkout_files()
        roots = [make_copy(files, scratch) for _ in range(max(1, args.jobs))]
        copies: Queue[Path] = Queue()
        for root in roots:
            copies.put(root)
        first = roots[0]
        check_copy_is_imported(first)

        # the clean run: the tests must pass before a failure can mean anything; it also sets the timeout
        baseline: dict[tuple[str, ...], float] = {}
        for tests in sorted({tests_for(m.module, args.thorough) for m in chosen}):
            status, seconds, failed = run_tests(first, tests, marker, timeout=3600)
            if status != "survived":
                raise SystemExit(f"mutants: the tests fail without any mutant ({failed}): {' '.join(tests)}")
            baseline[tests] = seconds
            print(f"clean run {seconds:.0f} s: {' '.join(tests)}", flush=True)

        def test_one(mutant: Mutant) -> Outcome:
            root = copies.get()
            target = root / mutant.module
            source = target.read_text(encoding="utf-8")
            try:
                target.write_text(mutant.apply(source), encoding="utf-8")
                tests = tests_for(mutant.module, args.thorough)
                status, seconds, killed_by = run_tests(root, tests, marker,
                                                       args.timeout or 3 * baseline[tests] + 60)
            finally:
                target.write_text(source, encoding="utf-8")
                copies.put(root)
            return Outcome(mutant, status, seconds, killed_by)

        outcomes = list(stale)
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for i, outcome in enumerate(pool.map(test_one, chosen), 1):
                outcomes.append(outcome)
                print(f"[{i}/{len(chosen)}] {outcome.status:8} {outcome.seconds:5.0f} s  {describe(outcome.mutant)}",
                      flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return report(outcomes, args, available)


def describe(mutant: Mutant) -> str:
    """file:line:col [what] the line before => the line after."""
    return (f"{mutant.module}:{mutant.line}:{mutant.col} [{mutant.name or mutant.operator}] "
            f"{_short(mutant.line_before)}  =>  {_short(mutant.line_after)}")


def _short(text: str, width: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def report(outcomes: list[Outcome], args, available: int) -> int:
    counted = [o for o in outcomes if o.status != "not applicable"]
    killed = [o for o in counted if o.status in ("killed", "timeout", "error")]
    survivors = [o for o in counted if o.status == "survived"]
    score = len(killed) / len(counted) if counted else 0.0
    print(f"\nscore: {len(killed)} of {len(counted)} mutants killed ({100 * score:.0f}%)")
    for kind in ("curated", "generated"):
        part = [o for o in counted if (o.mutant.name is not None) == (kind == "curated")]
        if part:
            print(f"  {kind}: {sum(o.status != 'survived' for o in part)} of {len(part)} killed")
    if survivors:
        print("survivors (a bug the tests let through, or a change that means nothing):")
        for o in survivors:
            print(f"  {describe(o.mutant)}")
    for o in outcomes:
        if o.status == "not applicable":
            print(f"stale curated mutant: {o.mutant.name} ({o.mutant.module}): {o.killed_by}")
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps({
        "score": round(score, 4), "killed": len(killed), "total": len(counted), "generated_available": available,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "mutants": [asdict(o.mutant) | {"status": o.status, "seconds": round(o.seconds, 1), "killed_by": o.killed_by}
                    for o in outcomes],
    }, indent=2) + "\n", encoding="utf-8")
    print(f"report: {args.report}")
    # a curated bug that survives, or one that no longer applies, is a regression of the guards
    broken = [o for o in outcomes if o.mutant.name is not None and o.status in ("survived", "not applicable")]
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
