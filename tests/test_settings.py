"""Every setting declared once (prune_heads/pipeline/settings.py): the command line's options, the recipe schema, the
recipe's values and the Python API's keywords are derived from the declaration, and budget metrics from their
registry, so nothing can be declared in one place and missing from another."""
from __future__ import annotations

import typing
from dataclasses import fields

import click
import pytest

import prune_heads
from prune_heads.pipeline.merging import recipe_values
from prune_heads.pipeline.recipes import RECIPE_ONLY, load_recipe, recipe_schema
from prune_heads.pipeline.settings import Settings, declarations, default_of, reference_rows
from prune_heads.search.budget import METRIC_CHOICES, METRICS, REGISTRY, TEXT_METRICS, Budget
from prune_heads_cli.main import cli

MAIN_ONLY = {"metric", "no_guard", "push_to", "private", "version", "help", "out", "force"}  # not settings


def _params(command: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in command.params if isinstance(p, click.Option)}


def test_every_setting_has_one_declaration_and_every_flag_is_derived_from_it():
    declared = declarations()
    assert list(declared) == [f.name for f in fields(Settings)]
    assert all(d.help for d in declared.values())
    main = _params(cli)
    flagged = {name for name, d in declared.items() if d.flag is not None}
    assert set(main) - MAIN_ONLY == flagged  # the main command offers every setting that has a flag, nothing else
    for name in flagged:
        d, option = declared[name], main[name]
        assert option.opts[0] == (d.flag or "--" + name.replace("_", "-")) and option.help == d.help, name
        if d.choices:
            assert tuple(option.type.choices) == d.choices, name
    for command in ("score", "eval", "export", "study", "compare"):  # the common settings on every model command
        offered = _params(cli.commands[command])
        assert {n for n, d in declared.items() if d.flag is not None and d.commands == "common"} <= set(offered)
    assert {n for n, d in declared.items() if d.commands == "export"} <= set(_params(cli.commands["export"]))
    assert [row["name"] for row in reference_rows()] == list(declared)


def test_the_recipe_schema_and_values_come_from_the_declaration():
    schema = recipe_schema()
    keys = {d.recipe.split(".")[0] for d in declarations().values() if d.recipe}
    assert set(schema.model_fields) == keys | set(RECIPE_ONLY)
    blocks = {d.recipe.split(".")[0]: d.recipe.split(".")[1] for d in declarations().values()
              if d.recipe and "." in d.recipe}
    for block, key in blocks.items():
        inner = [a for a in typing.get_args(schema.model_fields[block].annotation) if a is not type(None)][0]
        assert key in inner.model_fields, (block, key)
    for device in ("cpu", "cuda"):  # every recipe value is a valid value of its setting, per device
        values = recipe_values(load_recipe("smollm2"), device)
        assert values["grid"] == (0.025, 0.05, 0.075, 0.10, 0.125, 0.15, 0.20, 0.25, 0.30)
        assert values["batch_size"] == (4 if device == "cpu" else 64)
        assert ("mmlu_subjects" in values) == (device == "cpu")
        assert dict(values["guard_tolerance"]) == dict(default_of("guard_tolerance"))


def test_every_budget_metric_is_registered_once_and_derived_everywhere():
    assert METRICS == tuple(REGISTRY) and set(TEXT_METRICS) == {n for n, m in REGISTRY.items() if m.on_text}
    assert set(METRIC_CHOICES) == set(METRICS) | {"mmlu", "mmlu-cloze"}
    assert set(typing.get_args(typing.get_args(recipe_schema().model_fields["metric"].annotation)[0])) == \
        set(METRIC_CHOICES)
    assert set(_params(cli)["metric"].type.choices) == set(METRIC_CHOICES)
    for name, metric in REGISTRY.items():
        budget = Budget.parse("0.05nat" if metric.in_nats else "2pt", name)
        assert str(budget).startswith(f"{budget.limit:g} {metric.phrase}") and budget.axis_label == metric.axis
        assert budget.on_text == metric.on_text


def test_the_api_takes_every_setting_by_name_and_checks_it_as_the_flag_would():
    from tiny import tiny_model

    from prune_heads.api.held import held, settings_of

    lm = held(tiny_model("llama").model, tiny_model("llama").tokenizer)
    settings, _ = settings_of(lm, budget="0.05nat", units="heads", gqa="balanced", calibration_size=3, guard=())
    assert (settings.units, settings.gqa, settings.calibration_size, settings.guard) == ("heads", "balanced", 3, ())
    with pytest.raises(prune_heads.UserError, match="`units` 'layers' is not one of gqa, heads"):
        settings_of(lm, units="layers")
    with pytest.raises(prune_heads.UserError, match="`calibration_size` 0 must be a whole number of at least 1"):
        settings_of(lm, calibration_size=0)
    with pytest.raises(TypeError, match="'guard_text'; did you mean 'guard_texts'"):
        settings_of(lm, guard_text="x")
