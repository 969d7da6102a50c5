"""The package's shape: imports point one way (cli -> commands -> runs -> train/backends ->
data/finetune/config/errors), no two modules import each other (function-level imports count), and
the modules that must stay light never import torch."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ptbr"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """module -> every ptbr module and top-level library it imports, anywhere in the file."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names |= {f"{node.module}.{alias.name}" for alias in node.names}
        found[module_name(path)] = names
    return found


def ptbr_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    modules = set(graph)
    return {m: {n for n in names if n in modules and n != m} for m, names in graph.items()}


def test_no_import_cycles():
    graph = ptbr_imports(imports())
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


LAYERS = {  # a module of the left may not import one of these
    "ptbr.data": ("ptbr.runs", "ptbr.train", "ptbr.backends", "ptbr.commands", "ptbr.preflight", "ptbr.finetune",
                  "ptbr.cli", "torch"),
    "ptbr.finetune.data": ("ptbr.runs", "ptbr.train", "ptbr.backends", "torch"),
    "ptbr.finetune.batches": ("ptbr.runs", "ptbr.train", "ptbr.backends", "torch"),
    "ptbr.finetune.base": ("ptbr.runs", "ptbr.train", "ptbr.backends", "torch"),
    "ptbr.train": ("ptbr.runs", "ptbr.commands", "ptbr.cli", "ptbr.preflight", "ptbr.finetune", "torch"),
    "ptbr.backends": ("ptbr.runs", "ptbr.commands", "ptbr.cli", "ptbr.preflight"),
    "ptbr.runs": ("ptbr.commands", "ptbr.cli", "ptbr.preflight", "torch", "mlx"),
    "ptbr.preflight": ("ptbr.runs", "ptbr.commands", "ptbr.cli"),
    "ptbr.config": ("torch", "ptbr.train", "ptbr.runs", "ptbr.backends"),
    "ptbr.flags": ("torch", "ptbr.commands", "ptbr.runs", "ptbr.preflight"),
    "ptbr.cli": ("torch", "ptbr.preflight", "ptbr.runs", "ptbr.backends"),
}


def test_imports_point_one_way():
    graph = imports()
    wrong = []
    for module, names in graph.items():
        for prefix, forbidden in LAYERS.items():
            if module == prefix or module.startswith(prefix + "."):
                wrong += [f"{module} imports {name}" for name in names
                          if any(name == f or name.startswith(f + ".") for f in forbidden)]
    assert not wrong, wrong


def test_the_mlx_backend_never_imports_torch():
    graph = imports()
    mlx = [m for m in graph if m.startswith("ptbr.backends.mlx")]
    # every ptbr module the MLX backend reaches, directly or not
    reach, todo = set(), list(mlx)
    modules = set(graph)
    while todo:
        module = todo.pop()
        if module in reach:
            continue
        reach.add(module)
        todo += [n for n in graph[module] if n in modules]
    offenders = sorted(f"{m} imports {n}" for m in reach for n in graph[m] if n == "torch" or n.startswith("torch."))
    assert not offenders, offenders
