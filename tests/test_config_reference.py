"""docs/configuration.md is the generator's output, and says what the validation enforces."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from extproc.cli import main
from extproc.config import ENV_PREFIX, RouterConfig
from extproc.config_reference import render, sections
from extproc.control.config import ControlPlaneConfig, HealthSettings, LoadFeedSettings
from extproc.errors import ConfigError

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
SCHEMAS: tuple[type, ...] = (RouterConfig, ControlPlaneConfig, HealthSettings, LoadFeedSettings)


def test_committed_reference_is_the_generators_output():
    assert REFERENCE.read_text() == render(), (
        "docs/configuration.md is stale: prefix-router config-reference > docs/configuration.md"
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
    for cls, prefix in [
        (RouterConfig, ""),
        (ControlPlaneConfig, ""),
        *((section, f"{name}.") for name, section in sections().items()),
    ]:
        for field in dataclasses.fields(cls):
            description = field.metadata.get("doc", "")
            assert description, f"{cls.__name__}.{field.name} has no doc metadata"
            part = _router_part() if cls is RouterConfig else _control_plane_part()
            assert description in _row(part, prefix + field.name)
    for field in dataclasses.fields(RouterConfig):
        assert f"`{ENV_PREFIX}{field.name.upper()}`" in _row(_router_part(), field.name)


def _outside(bound: float, direction: int) -> float:
    return bound + direction if isinstance(bound, int) else bound + direction * 1e-6


def _range_cases() -> list[Any]:
    cases = []
    for cls in SCHEMAS:
        defaults = cls()
        for field in dataclasses.fields(cls):
            if "range" not in field.metadata:
                continue
            low, high = (
                getattr(defaults, b) if isinstance(b, str) else b for b in field.metadata["range"]
            )
            cases.append(
                pytest.param(cls, field.name, low, high, id=f"{cls.__name__}.{field.name}")
            )
    return cases


@pytest.mark.parametrize(("cls", "name", "low", "high"), _range_cases())
def test_documented_ranges_are_the_enforced_ones(cls, name, low, high):
    # Fields bounded by this one (a timeout by its interval) sit at their own minimum.
    bounded = {
        f.name: f.metadata["range"][0]
        for f in dataclasses.fields(cls)
        if f.metadata.get("range", (None, None))[1] == name
    }
    assert getattr(cls(**bounded, **{name: low}), name) == low
    assert getattr(cls(**bounded, **{name: high}), name) == high
    for beyond in (_outside(low, -1), _outside(high, +1)):
        with pytest.raises(ConfigError) as caught:
            cls(**bounded, **{name: beyond})
        assert caught.value.field.endswith(name)


def test_documented_log_levels_are_accepted():
    for level in ("debug", "info", "warning", "error"):
        assert level in _row(_router_part(), "log_level")
        assert RouterConfig(log_level=level).log_level == level
    with pytest.raises(ConfigError):
        RouterConfig(log_level="verbose")
