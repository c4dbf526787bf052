"""Typed configs: YAML + dotted overrides, errors that name the key and the closest valid one."""

from pathlib import Path

import pytest

from k3post.config import ConfigError, K3Config, load_config, to_yaml

ROOT = Path(__file__).resolve().parents[1]


def test_demo_yaml_loads_and_overrides_apply():
    cfg = load_config(ROOT / "configs/demo.yaml", ["sft.lr=3e-4", "run.name=x", "data.efforts=[max,low]"])
    assert isinstance(cfg, K3Config)
    assert cfg.sft.lr == pytest.approx(3e-4)
    assert cfg.run.name == "x"
    assert cfg.data.efforts == ["max", "low"]
    assert cfg.qat.enabled is True


def test_demo_yaml_matches_defaults():
    # configs/demo.yaml spells out the defaults: `k3post demo` with and without it must agree
    assert to_yaml(load_config(ROOT / "configs/demo.yaml")) == to_yaml(load_config(None))


def test_unknown_override_names_key_and_suggestion():
    with pytest.raises(ConfigError, match=r"unknown config key 'sft.lrr'.*did you mean 'sft.lr'"):
        load_config(None, ["sft.lrr=1e-3"])


def test_unknown_yaml_key_names_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("sft:\n  stpes: 10\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown config key 'sft.stpes'.*'sft.steps'"):
        load_config(p)


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'sfft'.*did you mean 'sft'"):
        load_config(None, ["sfft.lr=1"])


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"sft.steps"):
        load_config(None, ["sft.steps=many"])


def test_section_given_scalar(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("sft: 3\n")
    with pytest.raises(ConfigError, match="'sft' is a section"):
        load_config(p)


def test_bad_yaml_and_missing_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("sft: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_override_without_equals():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["sft.lr"])


def test_dotted_override_reaches_mapping_entries_whose_names_contain_dots():
    """Family and expert names hold a dot; under a flat mapping field the rest of the key is one entry,
    while nested mappings (rl.domain_overrides.<domain>.<key>) still split."""
    cfg = load_config(None, ["data.family_tasks.coding.bugfix=3", "mopd.experts.general.max=/ckpt/g",
                             "rl.domain_overrides.agents.steps=5", "data.effort_mix.*/low=0.5"])
    assert cfg.data.family_tasks == {"coding.write_function": 100, "coding.bugfix": 3}
    assert cfg.mopd.experts == {"general.max": "/ckpt/g"}
    assert cfg.rl.domain_overrides["agents"]["steps"] == 5
    assert cfg.data.effort_mix["*/low"] == 0.5
    assert cfg.data.tasks_of("coding.bugfix") == 3 and cfg.data.tasks_of("agents.search") == cfg.data.n_per_family
    assert cfg.data.tasks_of("general.arithmetic") == cfg.data.n_train


@pytest.mark.parametrize("override, message", [
    ("data.family_tasks.coding.nope=3", r"data.family_tasks.coding.nope: unknown task family 'coding.nope'"),
    ("data.family_tasks.coding.bugfix=-1", r"data.family_tasks.coding.bugfix: must be a non-negative integer"),
    ("data.family_tasks.general.arithmetic=5", r"data.family_tasks.general.arithmetic: the eval family's task count is data.n_train"),
])
def test_bad_family_tasks_names_the_entry(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])
