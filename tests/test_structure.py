"""The shape of the code: the packages and the core's stages import only earlier stages (never a later one, never the
exporters or the CLI), no import cycles, no callable passed from one stage into another, no function over 60 lines or
8 parameters, no module over 400 lines, click only in the CLI, no line over 120 characters (ruff checks the rest in
CI)."""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import prune_heads

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prune_heads", "exporters", "prune_heads_cli")
# The order one run flows through (docs/ARCHITECTURE.md): a module may import its own stage and earlier ones only.
STAGES = (
    "prune_heads",  # the package root: the version
    "prune_heads.runtime",  # per-layer head counts on stock transformers classes (what an export needs to load)
    "prune_heads.errors",  # typed errors carrying facts
    "prune_heads.io",  # readers, files and the --out rule, cache, ranks, disk space
    "prune_heads.heads",  # HeadSet, ScoreTable
    "prune_heads.console",  # what a run says (the CLI shows it)
    "prune_heads.memory",  # the memory policy the entry point installs
    "prune_heads.timings",  # the run's clock: seconds per named stage
    "prune_heads.models",  # adapters (the only architecture knowledge), loading, geometry, pass budgets, counting
    "prune_heads.data",  # tasks, MMLU, calibration texts
    "prune_heads.plan",  # Planner/PrunePlan, slicing, ablation, healing
    "prune_heads.scoring",  # the one-pass hooks
    "prune_heads.eval",  # encoding, log-likelihood passes, results and paired statistics, text KL, cached work
    "prune_heads.search",  # budget, units, the search, verifier, selection, resolution, confirmation
    "prune_heads.report",  # report.json, plots, study, compare
    "prune_heads.pipeline",  # recipes, settings, inputs, the stages of one run, the main job's decision
    "prune_heads.api",  # the public Python API on a model in memory
    "exporters",  # formats built on the core
    "prune_heads_cli",  # the command table, options, and the wording of errors
)
MAX_PARAMETERS, MAX_MODULE_LINES = 8, 400
# The one import against the stages: the package root registers the per-layer classes with transformers' Auto
# classes, so `import prune_heads` is all a user needs to load a per-layer export.
REGISTRATION = ("prune_heads", "prune_heads.runtime")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
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


def stage_of(module: str) -> int:
    """The index in STAGES of the longest stage prefix of ``module``."""
    best = max((s for s in STAGES if module == s or module.startswith(s + ".")), key=len)
    return STAGES.index(best)


def test_every_module_has_a_stage():
    assert all(stage_of(m) > 0 or m == "prune_heads" for m in _modules())


def test_stages_import_only_earlier_stages():
    graph = _graph()
    back = [f"{m} ({STAGES[stage_of(m)]}) imports {t} ({STAGES[stage_of(t)]})" for m, ts in graph.items()
            for t in ts if stage_of(t) > stage_of(m) and (m, t) != REGISTRATION]
    assert back == []


def _imported_from(tree: ast.Module, name: str, modules: dict[str, Path]) -> dict[str, str]:
    """Names bound by imports in a module -> the package module they come from."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found[a.asname or a.name] = full if full in modules else node.module
        elif isinstance(node, ast.Import):
            for a in node.names:
                found[a.asname or a.name.split(".")[0]] = a.name
    return {k: v for k, v in found.items() if v in modules}


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


def test_no_untyped_parameter_hides_a_later_stage():
    """A parameter named after a class of a later stage (``run``: the pipeline's Run, ``verifier``: the search's
    Verifier) must be typed: untyped, it carries a later stage's object past the import check unseen."""
    modules = _modules()
    defined: dict[str, set[int]] = {}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                defined.setdefault(_snake(node.name), set()).add(stage_of(name))
    hidden = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                    later = {STAGES[s] for s in defined.get(a.arg, ()) if s > stage_of(name)}
                    if a.annotation is None and later:
                        hidden.append(f"{name}.{node.name}({a.arg}): untyped, named after a class of {later}")
    assert hidden == []


def test_no_callable_is_passed_from_one_stage_into_another():
    """Stages are joined by typed values: no parameter typed Callable, and no lambda or function of ours handed to a
    function of another stage."""
    modules, passed, typed = _modules(), [], []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        imported = _imported_from(tree, name, modules)
        methods = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
        defined = {n.name for n in ast.walk(tree)
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(n) not in methods}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                typed += [f"{path.name}:{node.name}({a.arg})" for a in args
                          if a.annotation is not None and "Callable" in ast.unparse(a.annotation)]
            if not isinstance(node, ast.Call):
                continue
            func = node.func.value if isinstance(node.func, ast.Attribute) else node.func
            callee = imported.get(func.id) if isinstance(func, ast.Name) else None
            if callee is None or stage_of(callee) == stage_of(name):
                continue
            values = node.args + [k.value for k in node.keywords]
            passed += [f"{path.name}:{node.lineno} -> {callee}" for v in values
                       if isinstance(v, ast.Lambda) or (isinstance(v, ast.Name) and v.id in defined)]
    assert typed == [] and passed == []


def test_no_function_over_8_parameters_and_no_module_over_400_lines():
    wide, long_modules = [], []
    for path in _modules().values():
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{path.relative_to(ROOT)} ({len(source.splitlines())} lines)")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                if len(names) > MAX_PARAMETERS:
                    wide.append(f"{path.name}:{node.name} ({len(names)} parameters)")
    assert wide == [] and long_modules == []


def test_click_only_in_the_cli():
    users = [name for name, path in _modules().items() if not name.startswith("prune_heads_cli")
             and any(isinstance(n, (ast.Import, ast.ImportFrom)) and "click" in ast.unparse(n).split()
                     for n in ast.walk(ast.parse(path.read_text())))]
    assert users == []


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


# Files named in the code that are not ours: written into every per-layer export, and llama.cpp's converter; and the
# recipes' package name in the wheel (recipes/ ships as prune_heads.recipe_files).
NOT_OURS = {"modeling_pruned.py", "convert_hf_to_gguf.py"}
NOT_MODULES = {"prune_heads.recipe_files"}


def test_no_docstring_or_comment_names_a_module_that_does_not_exist():
    """``NAME.py`` and ``prune_heads.x.y`` / ``exporters.x`` in docstrings and comments name files and modules that
    exist (a renamed module leaves no stale pointer behind)."""
    files = {p.name for package in (*PACKAGES, "tests", "benchmarks") for p in (ROOT / package).rglob("*.py")}
    files |= NOT_OURS
    modules, stale = _modules(), []
    public = {*prune_heads.__all__, "__all__"}  # prune_heads.score_heads: a public name of the package, not a module
    for name, path in modules.items():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            stale += [f"{path.relative_to(ROOT)}:{i}: {m}" for m in re.findall(r"\b\w+\.py\b", line) if m not in files]
            for dotted in re.findall(r"\b((?:prune_heads|prune_heads_cli|exporters)(?:\.\w+)+)", line):
                parts = dotted.split(".")
                known = any(".".join(parts[:k]) in modules for k in range(2, len(parts) + 1))
                if not known and parts[1] != "json" and dotted not in NOT_MODULES and not (
                        parts[0] == "prune_heads" and parts[1] in public):
                    stale.append(f"{path.relative_to(ROOT)}:{i}: {dotted}")
    assert stale == []


# Test files that follow a behaviour across modules rather than one module (docs/ARCHITECTURE.md, "Tests").
CROSS_CUTTING = {"benchmarks", "cli", "decision", "docs", "faults", "hostile", "integrity", "lm_eval", "resume", "safety",
                 "structure", "vllm"}


def test_a_modules_focused_test_is_found_by_its_name():
    """tests/test_X.py tests the module or package X (a newcomer finds it by name), or is one of the cross-cutting
    files listed in CROSS_CUTTING and in docs/ARCHITECTURE.md."""
    names = {p.stem for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    names |= {p.name for package in PACKAGES for p in (ROOT / package).rglob("*") if p.is_dir()}
    unnamed = [p.name for p in sorted((ROOT / "tests").glob("test_*.py"))
               if p.stem[len("test_"):] not in names | CROSS_CUTTING]
    assert unnamed == []
    documented = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    assert [f"test_{n}.py" for n in sorted(CROSS_CUTTING) if f"test_{n}.py" not in documented] == []
