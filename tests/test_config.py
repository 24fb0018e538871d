"""The typed config loader: nested dataclasses, Literal values, unknown keys, overrides."""
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from megatron_calibclip.config import (
    ConfigError,
    apply_overrides,
    from_dict,
    load_yaml,
    to_dict,
)


@dataclass
class Inner:
    granularity: Literal["tensorwise", "rowwise"] = "tensorwise"  # scaling
    margin: int = 0  # exponent margin


@dataclass
class Outer:
    name: str  # run name
    lr: float = 1e-6  # learning rate
    steps: Optional[int] = None  # stop after
    inner: Inner = field(default_factory=Inner)  # nested section
    tags: list[str] = field(default_factory=list)  # free-form


def test_nested_roundtrip():
    cfg = from_dict(Outer, {"name": "x", "lr": 1, "inner": {"granularity": "rowwise"}})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.inner == Inner("rowwise", 0)
    assert from_dict(Outer, to_dict(cfg)) == cfg


@pytest.mark.parametrize("data, match", [
    ({"name": "x", "inner": {"granularity": "rowise"}},
     r"inner.granularity: 'rowise' is not one of \['tensorwise', 'rowwise'\]"),
    ({"name": "x", "lrr": 1}, r"unknown key\(s\) \['lrr'\]; allowed keys are"),
    ({"name": "x", "steps": "many"}, "steps"),
    ({"name": "x", "inner": {"margin": 1.5}}, "inner.margin: expected an integer"),
    ({"name": "x", "tags": "a"}, "tags: expected a list"),
    ({}, "name"),
])
def test_errors_name_the_field(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(Outer, data)


def test_overrides_and_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: run\ninner:\n  margin: 1\n")
    data = apply_overrides(load_yaml(path), ["inner.granularity=rowwise", "lr=3e-6", "steps=5"])
    cfg = from_dict(Outer, data)
    assert (cfg.inner.granularity, cfg.inner.margin, cfg.lr, cfg.steps) == ("rowwise", 1, 3e-6, 5)
    with pytest.raises(ConfigError, match="must look like"):
        apply_overrides({}, ["lr"])
    with pytest.raises(ConfigError, match="not found"):
        load_yaml(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_yaml(tmp_path / "list.yaml")
