"""docs/configuration.md and docs/schema/*.json are the generator's output, and say what
the validation enforces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from extproc.cli import main
from extproc.config import ENV_PREFIX, LOG_LEVELS, RouterConfig
from extproc.config_reference import SCHEMAS, json_schema, json_schema_text, render, sections
from extproc.control.config import ControlPlaneConfig, HealthSettings, LoadFeedSettings
from extproc.errors import ConfigError
from extproc.schema import bounds, restart_fields, sibling_bound, validated

DOCS = Path(__file__).resolve().parents[1] / "docs"
REFERENCE = DOCS / "configuration.md"
MODELS: tuple[type[BaseModel], ...] = (
    RouterConfig,
    ControlPlaneConfig,
    HealthSettings,
    LoadFeedSettings,
)


def test_committed_reference_is_the_generators_output():
    assert REFERENCE.read_text() == render(), (
        "docs/configuration.md is stale: prefix-router config-reference > docs/configuration.md"
    )


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_committed_schemas_are_the_generators_output(name):
    path = DOCS / "schema" / f"{name}.schema.json"
    assert path.read_text() == json_schema_text(name), (
        f"{path} is stale: prefix-router config-schema {name} > {path}"
    )


def test_cli_prints_the_reference(capsys):
    assert main(["config-reference"]) == 0
    assert capsys.readouterr().out == render()


def _row(text: str, name: str) -> str:
    (line,) = [line for line in text.splitlines() if line.startswith(f"| `{name}` |")]
    return line


def _router_part() -> str:
    return render().split("## Control plane")[0]


def _control_plane_part() -> str:
    return render().split("## Control plane")[1]


def test_every_field_has_a_row_with_its_description():
    for model, prefix in [
        (RouterConfig, ""),
        (ControlPlaneConfig, ""),
        *((section, f"{name}.") for name, section in sections().items()),
    ]:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            part = _router_part() if model is RouterConfig else _control_plane_part()
            assert field.description in _row(part, prefix + name)
    for name in RouterConfig.model_fields:
        assert f"`{ENV_PREFIX}{name.upper()}`" in _row(_router_part(), name)


def _outside(bound: float, direction: int) -> float:
    return bound + direction if isinstance(bound, int) else bound + direction * 1e-6


def _range_cases() -> list[Any]:
    cases = []
    for model in MODELS:
        for name, field in model.model_fields.items():
            limits = bounds(field)
            if limits is None or sibling_bound(field):
                continue
            cases.append(pytest.param(model, name, *limits, id=f"{model.__name__}.{name}"))
    return cases


@pytest.mark.parametrize(("model", "name", "low", "high"), _range_cases())
def test_documented_ranges_are_the_enforced_ones(model, name, low, high):
    # Fields bounded by this one (a timeout by its interval) sit at their own minimum.
    bounded = {
        other: bounds(field)[0]
        for other, field in model.model_fields.items()
        if sibling_bound(field) == name
    }
    assert getattr(model(**bounded, **{name: low}), name) == low
    assert getattr(model(**bounded, **{name: high}), name) == high
    for beyond in (_outside(low, -1), _outside(high, +1)):
        with pytest.raises(ConfigError) as caught:
            validated(model, {**bounded, name: beyond})
        assert caught.value.field.endswith(name)
    schema = json_schema("router" if model is RouterConfig else "control-plane")
    properties = (
        schema["properties"]
        if model in (RouterConfig, ControlPlaneConfig)
        else schema["$defs"][model.__name__]["properties"]
    )
    declared = properties[name]
    declared = next((d for d in declared.get("anyOf", [declared]) if "minimum" in d), declared)
    assert (declared["minimum"], declared["maximum"]) == (low, high)


@pytest.mark.parametrize("model", [HealthSettings, LoadFeedSettings])
def test_a_timeout_is_bounded_by_its_interval(model):
    assert model(interval_s=1, timeout_s=1).timeout_s == 1
    with pytest.raises(ConfigError) as caught:
        validated(model, {"interval_s": 1, "timeout_s": 1.5})
    assert caught.value.field == "timeout_s"
    assert "interval_s" in caught.value.allowed


def test_documented_log_levels_are_accepted():
    for level in LOG_LEVELS:
        assert f"`{level}`" in _row(_router_part(), "log_level")
        assert RouterConfig(log_level=level).log_level == level
    with pytest.raises(ConfigError):
        validated(RouterConfig, {"log_level": "verbose"})


def test_schema_rejects_unknown_fields_and_names_the_enums():
    schema = json.loads(json_schema_text("router"))
    assert schema["additionalProperties"] is False
    strategies = schema["$defs"]["Strategy"]["enum"]
    assert strategies == ["RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE"]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_cli_prints_the_schema(name, capsys):
    assert main(["config-schema", name]) == 0
    assert capsys.readouterr().out == json_schema_text(name)


def test_the_reference_says_which_fields_need_a_restart():
    # One list per config, from the fields' declarations: what a reload keeps is what the
    # reference tells the reader to restart for.
    router_part, control_part = render().split("## Control plane", 1)
    control_part = control_part.split("### ", 1)[0]
    for model, text in ((RouterConfig, router_part), (ControlPlaneConfig, control_part)):
        fields = restart_fields(model)
        assert "listen" in fields and "tls_cert_file" in fields
        for name in model.model_fields:
            (row,) = [line for line in text.splitlines() if line.startswith(f"| `{name}` |")]
            assert ("Restart to change" in row) == (name in fields), (model.__name__, name)
