"""The shape of the code: the core never imports the exporters or the CLI, no import cycles, no function over 60
lines, no line over 120 characters (ruff checks the rest in CI)."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prune_heads", "exporters", "prune_heads_cli")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "templates" in path.parts:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + int(is_package)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_layers_point_one_way():
    graph = _graph()
    back = [(m, t) for m, ts in graph.items() for t in ts
            if (m.startswith("prune_heads.") or m == "prune_heads") and t.startswith(("exporters", "prune_heads_cli"))]
    back += [(m, t) for m, ts in graph.items() for t in ts
             if m.startswith("exporters") and t.startswith("prune_heads_cli")]
    assert back == []


def test_no_import_cycles():
    graph, state, cycles = _graph(), defaultdict(int), []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state[nxt] == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif state[nxt] == 0:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if state[node] == 0:
            visit(node, [node])
    assert cycles == []


def test_no_function_over_60_lines_and_no_line_over_120():
    long_functions, long_lines = [], []
    for path in _modules().values():
        source = path.read_text()
        long_lines += [f"{path.name}:{i}" for i, line in enumerate(source.splitlines(), 1) if len(line) > 120]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long_functions.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long_functions == [] and long_lines == []
