"""lm-evaluation-harness's task index as prune-heads reads it, before any task is built or any weights load: the
task names a run asks for (``--task lm-eval:NAME``), one TaskManager per process for the same task directories,
every local file a task reads (its YAMLs, data and few-shot files, ``!function`` modules: the inputs an ``--out``
may not hold), the user's own code named where it runs and where it raises, and the task settings that cannot run,
refused in one line each. ``lm_eval_tasks`` builds the tasks from here.

lm-eval is an optional dependency (the ``lm-eval`` extra): nothing here imports it until a task of it is asked for.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from prune_heads.console import say
from prune_heads.errors import UserError

PREFIX = "lm-eval:"

INSTALL = "pip install 'prune-heads[lm-eval]'"

EXAMPLES = Path(__file__).with_name("lm_eval_tasks")  # small example tasks with local data, shipped with prune-heads

OUTPUT_TYPES = ("multiple_choice", "generate_until", "loglikelihood_rolling", "loglikelihood")


def is_lm_eval(task: str | None) -> bool:
    return bool(task) and task.startswith(PREFIX)


def task_names(task: str) -> list[str]:
    names = [n.strip() for n in task[len(PREFIX):].split(",") if n.strip()]
    if not names:
        raise UserError(f"`task` {task!r} names no lm-eval task; write lm-eval:NAME or lm-eval:NAME,NAME")
    return names


@dataclass(frozen=True)
class LmEvalSpec:
    """Which lm-eval tasks a run reads and how: names, the user's task directory, a few-shot override, a limit."""

    task: str  # lm-eval:NAME[,NAME...]
    include: str | None = None  # --lm-eval-include DIR: the user's task YAMLs
    num_fewshot: int | None = None  # --num-fewshot: overrides every task's YAML
    limit: int | None = None  # --task-limit: the first N documents of each task


def require_lm_eval() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise UserError(f"lm-eval tasks need lm-evaluation-harness, which is not installed; install it with: {INSTALL}")


def check_include(include: str | None) -> None:
    if include is None:
        return
    path = Path(include)
    if not path.is_dir():
        raise UserError(f"`lm_eval_include` {include} is not a directory; pass a directory of lm-eval task YAMLs")
    yamls = list(path.rglob("*.yaml"))
    if not yamls:
        raise UserError(f"`lm_eval_include` {include} holds no .yaml task files; pass a directory of lm-eval task "
                        "YAMLs (see lm-eval's docs/new_task_guide.md)")
    odd = next((p for p in yamls if not p.is_file()), None)  # a FIFO or socket blocks the reader for ever
    if odd is not None:
        raise UserError(f"`lm_eval_include` {include} holds {odd.name}, which is not a regular file (a pipe, a "
                        "socket or a device); move it out of the task directory")


def task_manager(include: str | None):
    """lm-eval's TaskManager over its own tasks, the shipped examples and the user's directory. Indexing lm-eval's
    ~15,000 task YAMLs takes 15-30 s: they are indexed once per process, and one manager is kept for the same
    directories in the same state (every YAML's path, size and modification time): a command that loads its tasks
    twice, or a second command in the same process, indexes once; an edited, added or removed YAML of the user's is
    indexed anew, alone."""
    paths = (str(EXAMPLES),) + ((str(Path(include).resolve()),) if include else ())
    return _task_manager(paths, tuple(_yaml_state(p) for p in paths))


def _yaml_state(directory: str) -> tuple:
    """(path, size, mtime) of every YAML under ``directory``, from stat alone (no file is opened)."""
    found = []
    for path in sorted(Path(directory).rglob("*.yaml")):
        st = path.stat()
        found.append((str(path), st.st_size, st.st_mtime_ns))
    return tuple(found)


@functools.lru_cache(maxsize=4)
def _task_manager(paths: tuple[str, ...], state: tuple):
    """lm-eval's own tasks are indexed once per process (installed files: they do not change under a run); the
    directories in ``paths`` are indexed on their own and laid over them, later ones overriding earlier ones, as
    lm-eval's own index does (a user's task named like one of lm-eval's wins, and is said)."""
    from lm_eval.tasks import TaskManager

    own = _lm_eval_own_index()
    manager = TaskManager(include_path=list(paths), include_defaults=False)
    if own is None or not isinstance(getattr(manager, "_index", None), dict):  # another layout of lm-eval's index
        return TaskManager(include_path=list(paths))
    for name in sorted(set(own) & set(manager._index)):
        say(f"lm-eval task {name} of {manager._index[name].yaml_path} overrides lm-eval's own")
    _set_index(manager, {**own, **manager._index})
    return manager


@functools.lru_cache(maxsize=1)
def _lm_eval_own_index() -> dict | None:
    from lm_eval.tasks import TaskManager

    index = getattr(TaskManager(), "_index", None)
    return dict(index) if isinstance(index, dict) else None


def _set_index(manager, index: dict) -> None:
    """``manager``'s index and its name lists, as lm-eval's TaskManager derives them from its index."""
    from collections import defaultdict

    from lm_eval.tasks._index import Kind

    kinds = defaultdict(list)
    for name, entry in index.items():
        kinds[entry.kind].append(name)
    manager._index = index
    manager._all_tasks = sorted(index)
    manager._all_subtasks = sorted(kinds[Kind.TASK] + kinds[Kind.PY_TASK])
    manager._all_groups = sorted(kinds[Kind.GROUP])
    manager._all_tags = sorted(kinds[Kind.TAG])


def task_files(spec: LmEvalSpec) -> tuple[str, ...]:
    """Every local file the tasks of ``spec`` read, as lm-eval's index knows them (no task is built): each task's
    YAML and the YAMLs it includes, its data and few-shot files (``dataset_kwargs``' ``data_files``, a local
    ``dataset_path``), and the Python modules its ``!function`` entries run; a group's tasks too. An ``--out`` may
    hold none of them, with or without ``--force`` (they are the run's inputs)."""
    manager = task_manager(spec.include)
    found: set[Path] = set()
    todo, seen = list(task_names(spec.task)), set()
    while todo:
        name = todo.pop()
        entry = manager.task_index.get(name) if isinstance(name, str) else None
        if entry is None or name in seen:
            continue
        seen.add(name)
        if entry.yaml_path is not None:
            found |= _yaml_chain(Path(entry.yaml_path))
        cfg = entry.cfg or {}
        base = Path(entry.yaml_path).parent if entry.yaml_path is not None else Path.cwd()
        found |= _data_files(cfg, base) | _function_modules(cfg)
        members = cfg.get("task") if entry.kind.name == "GROUP" else None
        todo += [m if isinstance(m, str) else m.get("task") for m in (members or [])
                 if isinstance(m, (str, dict))]
    return tuple(sorted(str(p) for p in found))


def _yaml_chain(path: Path, depth: int = 0) -> set[Path]:
    """``path`` and the YAMLs it includes, transitively; what cannot be read ends its chain (``_includes`` says why)."""
    import yaml

    found = {path.resolve()}
    if depth > 32 or not path.is_file():
        return found
    try:
        targets = _included(path)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return found
    for target in targets:
        found |= _yaml_chain(target, depth + 1)
    return found


def _included(path: Path) -> list[Path]:
    """The YAMLs ``path`` names in ``include`` (lm-eval resolves them against the file's directory); raises what
    reading it raises."""
    import yaml

    raw = yaml.load(path.read_bytes().decode("utf-8"), Loader=_ignoring_tags())
    include = raw.get("include") if isinstance(raw, dict) else None
    return [Path(item) if Path(item).is_absolute() else path.parent / item
            for item in ([include] if isinstance(include, str) else include or []) if isinstance(item, str)]


def _ignoring_tags():
    """A safe YAML loader that reads ``!function x.y`` as a plain string (the index already resolved those)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    return Loader


def _data_files(cfg: dict, base: Path) -> set[Path]:
    """The local data files a task config names (relative ones as lm-eval reads them: from the working
    directory)."""
    kwargs = cfg.get("dataset_kwargs") or {}
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    names = list(files.values()) if isinstance(files, dict) else [files]
    flat = [f for n in names for f in (n if isinstance(n, list) else [n]) if isinstance(f, str)]
    path = cfg.get("dataset_path")
    if isinstance(path, str) and Path(path).exists():
        flat.append(path)
    return {Path(f).resolve() for f in flat}


def _function_modules(cfg: object) -> set[Path]:
    """The Python files of a config's ``!function`` entries: in the index they read ``DIR/module.function``."""
    found: set[Path] = set()
    values = cfg.values() if isinstance(cfg, dict) else cfg if isinstance(cfg, list) else []
    for value in values:
        if isinstance(value, (dict, list)):
            found |= _function_modules(value)
        elif isinstance(value, str) and "/" in value and "." in Path(value).name:
            module, _, _ = Path(value).name.rpartition(".")
            candidate = Path(value).parent / (module.replace(".", "/") + ".py")
            if candidate.is_file():
                found.add(candidate.resolve())
    return found


def check_documents(name: str, task) -> None:
    """A perplexity task whose every document is empty scores nothing (lm-eval's perplexity divides by its words)."""
    if task.OUTPUT_TYPE == "loglikelihood_rolling" and not any(
            str(task.doc_to_target(doc)).strip() for doc in task.eval_docs):
        raise UserError(f"lm-eval task {name} is a perplexity task, but every one of its documents is empty; give it "
                        "documents with text")


def check_fewshot(name: str, task, asked: int | None) -> None:
    """A few-shot count the task cannot take: more exemplars than its few-shot documents hold."""
    wanted = task.config.num_fewshot or 0
    if not wanted:
        return
    docs = task.fewshot_docs()
    pool = len(docs) if docs is not None else max(0, len(task.eval_docs) - 1)
    if wanted > pool:
        raise UserError(f"lm-eval task {name} asks for {wanted} few-shot exemplars but its few-shot documents hold "
                        f"{pool}; lower `num_fewshot` (or the task's num_fewshot) to at most {pool}")


def check_data_files(files: tuple[str, ...]) -> None:
    """The tasks' local JSON data, read before lm-eval and datasets do: an empty file, or a line that is not JSON,
    is one line naming the file and the line (datasets says StopIteration, or two lines without either)."""
    import json

    for name in files:
        path = Path(name)
        if path.suffix not in (".json", ".jsonl") or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            raise UserError(f"the lm-eval data file {path} is empty; give it one JSON document per line")
        lines = text.splitlines() if path.suffix == ".jsonl" else [text]
        for number, line in enumerate(lines, 1):
            try:
                json.loads(line) if line.strip() else None
            except ValueError as e:
                where = f", line {number}," if path.suffix == ".jsonl" else ""
                raise UserError(f"the lm-eval data file {path}{where} is not valid JSON ({e.msg}); fix that "
                                "line") from None


def unreadable_yaml(include: str | None) -> tuple[str, str] | None:
    """(the first task YAML of ``include`` that cannot be read, why): a syntax error, bytes that are not UTF-8, an
    include that is missing or comes back to itself."""
    import yaml

    for path in sorted(Path(include).rglob("*.yaml")) if include else []:
        try:
            _includes(path, ())
        except UnicodeDecodeError:
            return str(path), "it is not UTF-8 text"
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            return str(path), f"YAML syntax error{f' at line {mark.line + 1}' if mark else ''}"
        except (OSError, RecursionError, ValueError) as e:
            return str(path), str(e)
    return None


def _includes(path: Path, chain: tuple[Path, ...]) -> None:
    """Read ``path`` and, transitively, the YAMLs it includes: raises on the first that cannot be read."""
    if path.resolve() in chain:
        raise ValueError(f"its include comes back to {path.name} (a cycle)")
    if not path.is_file():
        raise ValueError(f"it includes {path}, which does not exist")
    for target in _included(path):
        _includes(target, (*chain, path.resolve()))


MAX_GEN_TOKS = 1 << 16  # more new tokens than any context prune-heads evaluates holds


def check_generation(name: str, task) -> None:
    """Generation settings that cannot run, one line each before any model loads: ``max_gen_toks`` that is not a
    count of tokens (negative, zero, absurd), and sampling at temperature 0 (which transformers refuses)."""
    if task.OUTPUT_TYPE != "generate_until":
        return
    kwargs = dict(task.config.generation_kwargs or {})
    most = kwargs.get("max_gen_toks")
    if most is not None and (isinstance(most, bool) or not isinstance(most, int) or not 1 <= most <= MAX_GEN_TOKS):
        raise UserError(f"lm-eval task {name}: generation_kwargs max_gen_toks {most!r} is not a number of tokens "
                        f"from 1 to {MAX_GEN_TOKS:,}; set it in the task's YAML")
    if kwargs.get("do_sample") and kwargs.get("temperature", 1.0) in (0, 0.0):
        raise UserError(f"lm-eval task {name} samples (do_sample: true) at temperature 0, which cannot run; drop "
                        "do_sample for greedy generation, or give a temperature above 0")


def samples(task) -> bool:
    """Whether a generative task samples its generations (``do_sample``) rather than decoding greedily."""
    return bool(dict(getattr(task.config, "generation_kwargs", None) or {}).get("do_sample"))


@functools.lru_cache(maxsize=64)
def say_once(message: str) -> None:
    """A command loads its tasks more than once (eval: the data, then each evaluation): the line is said once."""
    say(message)


def your_code(spec: LmEvalSpec) -> tuple[str, ...]:
    """The Python files of the user's own that ``spec``'s tasks run (their ``!function`` entries), lm-eval's and
    prune-heads' shipped tasks left out."""
    return tuple(f for f in task_files(spec) if f.endswith(".py") and not _shipped(f))


def code_of(tasks: dict[str, object]) -> tuple[str, ...]:
    """The Python files of the user's own behind built tasks' functions (``doc_to_text``, ``process_results``, ...)."""
    files = set()
    for task in tasks.values():
        for value in vars(getattr(task, "config", None) or object()).values():
            code = getattr(value, "__code__", None)
            if code is not None:
                files.add(str(Path(code.co_filename).resolve()))
    return tuple(sorted(f for f in files if not _shipped(f)))


def _shipped(path: str) -> bool:
    import lm_eval

    return any(Path(path).is_relative_to(root) for root in (Path(lm_eval.__file__).parent.resolve(),
                                                            EXAMPLES.resolve()))


def raised_in_user_code(error: BaseException, user_code: tuple[str, ...], task: str) -> None:
    """Raise a one-line ``UserError`` naming the module and function when ``error`` was raised inside the user's
    own task code (``your_code``), so that it is not blamed on the data or the network."""
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__) if str(Path(f.filename).resolve()) in user_code]
    if frames:
        where = frames[-1]
        first = (str(error).strip().splitlines() or [""])[0][:160]
        raise UserError(f"your lm-eval task code raised {type(error).__name__} ({first}) in {where.filename}, "
                        f"function {where.name}, line {where.lineno}, while {task} was loaded or evaluated; fix that "
                        "function (the task's !function entry)") from None
