"""Typed configs: YAML + dotted overrides, errors that name the key and the closest valid one."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3post.config import ConfigError, K3Config, config_tree, load_config, to_yaml
from k3post.config.rl import AGENTS_RL_SETTING, CODING_RL_SETTING, domain_override_args, flat_settings

ROOT = Path(__file__).resolve().parents[1]


def test_demo_yaml_loads_and_overrides_apply():
    cfg = load_config(ROOT / "configs/demo.yaml", ["sft.lr=3e-4", "run.name=x", "data.efforts=[max,low]"])
    assert isinstance(cfg, K3Config)
    assert cfg.sft.lr == pytest.approx(3e-4)
    assert cfg.run.name == "x"
    assert cfg.data.efforts == ["max", "low"]
    assert cfg.qat.enabled is True


def test_demo_yaml_matches_defaults():
    # configs/demo.yaml spells out the defaults: `k3post demo` with and without it must agree, but for the thread
    # count, which the file pins (its numbers are those of 2 threads) and the default chooses from the cores
    demo = load_config(ROOT / "configs/demo.yaml")
    assert (demo.run.threads, load_config(None).run.threads) == (2, 0)
    assert to_yaml(demo) == to_yaml(load_config(None, ["run.threads=2"]))


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
    assert cfg.data.family_tasks == {"coding.write_function": 200, "agents.search": 200, "coding.bugfix": 3}
    assert cfg.mopd.experts == {"general.max": "/ckpt/g"}
    assert cfg.rl.domain_overrides["agents"]["steps"] == 5
    assert cfg.data.effort_mix["*/low"] == 0.5
    assert cfg.data.tasks_of("coding.bugfix") == 3 and cfg.data.tasks_of("agents.assistant") == cfg.data.n_per_family
    assert cfg.data.tasks_of("general.arithmetic") == cfg.data.n_train


def test_domain_overrides_set_the_lr_schedule_and_numbers_given_as_text():
    """``lr_schedule`` (a choice, not a number) may be set per domain; a number written as YAML 1.1 reads 2e-4
    (text) is still a number."""
    cfg = load_config(None, ["rl.domain_overrides.general.optim.lr_schedule=linear", "rl.domain_overrides.general.optim.lr=2e-4"])
    general, agents = cfg.rl.for_domain("general", "max"), cfg.rl.for_domain("agents", "max")
    assert (general.optim.lr_schedule, general.optim.lr) == ("linear", 2e-4)
    assert (agents.optim.lr_schedule, agents.optim.lr) == (cfg.rl.optim.lr_schedule, cfg.rl.optim.lr) == ("constant", 1e-4)
    assert general.lr_at(general.steps - 1) == pytest.approx(2e-4 / general.steps)


@pytest.mark.parametrize("domain, setting", [("agents", AGENTS_RL_SETTING), ("coding", CODING_RL_SETTING)])
def test_domain_rl_setting_as_overrides_and_in_the_full_recipe(domain, setting):
    """`AGENTS_RL_SETTING` / `CODING_RL_SETTING` through `domain_override_args` set each field on top of the demo's
    entry (which keeps its other fields); configs/full.yaml trains the domain with it, per family (two families: half
    the tasks and held-out tasks each)."""
    cfg = load_config(None, domain_override_args(setting))
    base = load_config(None)
    for effort in ("max", "high", "low"):
        got, was = cfg.rl.for_domain(domain, effort), base.rl.for_domain(domain, effort)
        want = {**flat_settings(domain, setting[domain]), **flat_settings(effort, setting.get(f"{domain}.{effort}"))}
        assert {k: got.setting(k) for k in want} == want
        # the fields it does not name are the demo's
        assert (got.rollout.max_tokens, got.rollout.k) == (was.rollout.max_tokens, was.rollout.k)
    assert cfg.rl.for_domain(domain, "high").steps == base.rl.for_domain(domain, "high").steps == 16
    full = load_config(ROOT / "configs/full.yaml")
    families = [f for f in full.rl.families if f.startswith(f"{domain}.")]
    for effort in ("max", "high", "low"):
        got = full.rl.for_domain(domain, effort)
        want = {**flat_settings(domain, setting[domain]), **flat_settings(effort, setting.get(f"{domain}.{effort}"))}
        want.update(n_tasks=want["n_tasks"] // len(families), eval_n=want["eval_n"] // len(families))
        if effort != "max":
            want.pop("steps", None)
        assert {k: got.setting(k) for k in want} == want, effort


def test_demo_agents_and_coding_roll_out_as_their_settings():
    """The demo's coding experts sample, pick tasks and stay on-policy exactly as the setting that made RL beat SFT
    (fewer steps and tasks); its agents experts pick tasks and stay on-policy as theirs, at T 0.5 where
    `AGENTS_RL_SETTING` samples at T 1 over its larger pool (issue 31 §agents25)."""
    base = load_config(None)
    for domain, setting in (("agents", AGENTS_RL_SETTING), ("coding", CODING_RL_SETTING)):
        got = base.rl.for_domain(domain, "max")
        want = flat_settings(domain, setting[domain])
        for key in ("train_pass_min", "train_pass_empty", "rollout.lambda_", "rollout.max_staleness"):
            assert got.setting(key) == want[key], (domain, key)
    assert base.rl.for_domain("coding", "max").rollout.temperature == CODING_RL_SETTING["coding"]["rollout"]["temperature"] == 0.5
    assert (base.rl.for_domain("agents", "max").rollout.temperature,
            AGENTS_RL_SETTING["agents"]["rollout"]["temperature"]) == (0.5, 1.0)


@pytest.mark.parametrize("override, message", [
    ("data.family_tasks.coding.nope=3", r"data.family_tasks.coding.nope: unknown task family 'coding.nope'"),
    ("data.family_tasks.coding.bugfix=-1", r"data.family_tasks.coding.bugfix: must be a non-negative integer"),
    ("data.family_tasks.general.arithmetic=5", r"data.family_tasks.general.arithmetic: the eval family's task count is data.n_train"),
])
def test_bad_family_tasks_names_the_entry(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_deal_efforts_names_families_and_rejects_a_bad_one():
    assert load_config(None, ["data.deal_efforts=[coding.write_function]"]).data.deal_efforts == ["coding.write_function"]
    assert load_config(None, []).data.deal_efforts == []
    for override, message in [
        ("data.deal_efforts=[coding.nope]", r"data.deal_efforts: unknown task family"),
        ("data.deal_efforts=[general.arithmetic]", r"data.deal_efforts: general.arithmetic is the eval family"),
    ]:
        with pytest.raises((ValueError, ConfigError), match=message):
            load_config(None, [override])


def test_family_efforts_set_one_familys_efforts_and_name_a_bad_entry():
    cfg = load_config(None, ["data.family_efforts.agents.search=[high, low]"])
    assert cfg.data.efforts_of("agents.search") == ["high", "low"]
    assert cfg.data.efforts_of("agents.assistant") == cfg.data.efforts == ["max", "high", "low"]
    for override, message in [
        ("data.family_efforts.agents.search=[huge]", r"data.family_efforts.agents.search: a non-empty list of efforts out of \['low', 'high', 'max'\]"),
        ("data.family_efforts.agents.search=[]", r"data.family_efforts.agents.search: a non-empty list"),
        ("data.family_efforts.agents.search=high", r"bad value for 'data.family_efforts.agents.search'"),
        ("data.family_efforts.agents.nope=[high]", r"data.family_efforts.agents.nope: unknown task family"),
        ("data.family_efforts.general.arithmetic=[max]", r"data.family_efforts.general.arithmetic: the eval family's efforts are data.efforts"),
    ]:
        with pytest.raises((ValueError, ConfigError), match=message):
            load_config(None, [override])
    # only the run's efforts: a family whose efforts are none of them gets no samples
    assert load_config(None, ["data.efforts=[low, max]"]).data.efforts_of("agents.search") == ["low"]
    assert load_config(None, ["data.efforts=[max]"]).data.efforts_of("agents.search") == []


_HEAVY = ("torch", "transformers", "k3post.stages.rl", "k3post.stages.mopd", "k3post.stages.sft", "k3post.rollout.embedded")


def test_loading_a_config_imports_no_torch_and_no_stage():
    # the loader and the per-component config modules import neither torch nor a stage: reading a YAML
    # file must not load the engine (a fresh interpreter, so nothing else has imported them already)
    code = ("import sys, k3post.config as c; c.load_config('configs/demo.yaml'); c.load_config(None); "
            f"print(sorted(m for m in {_HEAVY!r} if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "[]", res.stdout


def test_mopd_imports_nothing_from_rl():
    # MOPD shares the loop (k3post.loop), the task streams (k3post.envs.families.streams) and the configs
    # (k3post.config), not the RL stage
    tree = ast.parse((ROOT / "k3post" / "stages" / "mopd.py").read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m == "k3post.stages.rl" or m.startswith("k3post.stages.rl.")], imported


def test_rl_components_are_sections_whose_defaults_are_declared_once():
    """``rl.rollout`` / ``rl.optim`` / ``rl.loss`` are the components' own dataclasses (each default declared there);
    MOPD's RL settings are the same tree; an RL setting's key from before the sections names its key now, in a config
    file, on the command line and in ``domain_overrides``."""
    import dataclasses

    from k3post.config import LossConfig, PolicyOptimConfig, RLConfig, RolloutConfig
    from k3post.config.rl import MOVED_KEYS

    cfg = load_config(None)
    assert (type(cfg.rl.rollout), type(cfg.rl.optim), type(cfg.rl.loss)) == (RolloutConfig, PolicyOptimConfig, LossConfig)
    assert cfg.rl.rollout.lambda_ == RolloutConfig().lambda_ == cfg.mopd.rl.rollout.lambda_ == 0.7
    assert (cfg.mopd.rl.rollout.n_prompts, cfg.mopd.rl.rollout.k) == (6, 4)
    top = {f.name for f in dataclasses.fields(RLConfig)}
    for old, new in MOVED_KEYS.items():  # every moved key names a field that exists, and none lives on twice
        section, name = new.split(".")
        assert old not in top and name in {f.name for f in dataclasses.fields(type(getattr(cfg.rl, section)))}, old
        with pytest.raises(ConfigError, match=rf"'rl.{old}' is now 'rl.{new}'"):
            load_config(None, [f"rl.{old}=1"])
    with pytest.raises(ValueError, match=r"rl.domain_overrides.coding.seq_mean: moved to rl.domain_overrides.coding.loss.seq_mean"):
        RLConfig(domain_overrides={"coding": {"seq_mean": True}})
    assert RLConfig().with_settings({"rollout": {"k": 2}, "optim.lr": 3e-4}).setting("rollout.k") == 2


def test_stage_modules_reexport_their_configs():
    import k3post.config as c
    from k3post.data import DataConfig
    from k3post.recipes.evaluate import EvalConfig
    from k3post.models import ModelConfig, TokenizerConfig
    from k3post.stages.mopd import MOPDConfig
    from k3post.quant.qat import QATConfig
    from k3post.rewards.effort import EffortConfig
    from k3post.config.rl import RLConfig
    from k3post.rollout.factory import RolloutConfig
    from k3post.stages.sft import SFTConfig
    from k3post.trainer import OptimConfig

    assert (DataConfig, EvalConfig, ModelConfig, TokenizerConfig, MOPDConfig, QATConfig, EffortConfig, RLConfig,
            RolloutConfig, SFTConfig, OptimConfig) == (c.DataConfig, c.EvalConfig, c.ModelConfig, c.TokenizerConfig,
                                                       c.MOPDConfig, c.QATConfig, c.EffortConfig, c.RLConfig,
                                                       c.RolloutConfig, c.SFTConfig, c.OptimConfig)
    assert RLConfig().loss.policy_loss_kwargs()["tau"] == RLConfig().loss.tau == 0.01


def test_constants_are_the_names_the_modules_use():
    from k3post import constants
    from k3post.envs.task import DOMAINS
    from k3post.quant.mx import MX_FORMATS
    from k3post.xtml import EFFORTS

    assert EFFORTS == constants.EFFORTS == ("low", "high", "max")
    assert DOMAINS == constants.DOMAINS == ("general", "agents", "coding")
    assert tuple(MX_FORMATS) == constants.MX_FORMAT_NAMES
    with pytest.raises(ValueError, match=r"QATConfig.weight_format='fp3' is not one of \['fp4_e2m1', 'fp8_e4m3', 'fp8_e5m2'\]"):
        load_config(None, ["qat.weight_format=fp3"])


def test_negative_lexicon_repeats_fails_at_load_naming_the_key():
    from k3post.config import load_config

    with pytest.raises(ValueError, match="tokenizer.lexicon_repeats must be an integer >= 0, got -1"):
        load_config(None, ["tokenizer.lexicon_repeats=-1"])


def test_range_semantics():
    """`Range`: closed and open bounds, NaN never inside, ±inf only with inf_ok, bools are not numbers."""
    from k3post.config.ranges import Range

    ge0, unit_open_low = Range(ge=0), Range(gt=0, le=1)
    assert ge0.contains(0) and ge0.contains(0.0) and not ge0.contains(-1e-12)
    assert not ge0.contains(float("nan")) and not ge0.contains(float("inf")) and not ge0.contains(True)
    assert not unit_open_low.contains(0) and unit_open_low.contains(1) and not unit_open_low.contains(1.0000001)
    band = Range(le=0, inf_ok=True)
    assert band.contains(float("-inf")) and not band.contains(float("inf")) and not band.contains(float("nan"))
    assert (str(ge0), str(unit_open_low), str(Range(ge=0, lt=1)), str(band)) == (
        ">= 0", "in (0, 1]", "in [0, 1)", "<= 0 (inf allowed)")


def test_defaults_and_shipped_configs_are_in_range():
    from k3post.config.ranges import check_ranges

    check_ranges(K3Config())
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)  # raises on a value outside its range


def test_a_range_error_names_where_the_value_was_set(tmp_path):
    """The file when the file set it, the override when an override did; an override that fixes a file's bad
    value loads (the last layer wins, as for every key)."""
    p = tmp_path / "c.yaml"
    p.write_text("sft:\n  lr: -0.5\n  warmup_steps: 3\n")
    with pytest.raises(ConfigError, match=rf"^{p}: sft.lr must be a number >= 0, got -0.5$"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"^override 'sft.warmup_steps=-1': sft.warmup_steps must be an integer >= 0, got -1$"):
        load_config(p, ["sft.lr=0.1", "sft.warmup_steps=-1"])
    assert load_config(p, ["sft.lr=0.1"]).sft.lr == 0.1
    assert load_config(None, ["rl.loss.clip_eps_low=.inf", "rl.loss.log_ratio_min=-.inf"]).rl.loss.log_ratio_min == float("-inf")


@pytest.mark.parametrize("path", [None, *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml"))])
def test_config_tree_and_yaml_are_omegaconfs(path):
    """`config_tree` / `to_yaml` read the dataclasses directly (OmegaConf built a node per value: ~70 ms a config,
    twice per command); the reference is OmegaConf's own container and YAML of the same config, byte for byte:
    every shipped config, and one with flat mappings, nested domain overrides, unicode and strings YAML would
    read as something else."""
    from omegaconf import OmegaConf

    tricky = ["rl.judge_model='yes'", "run.name=über-run", "data.family_tasks.coding.write_function=7",
              "mopd.experts.general.max=/tmp/x y", "rl.domain_overrides.coding.rollout.k=3", "sft.lr=1e-5",
              "data.efforts=[low, max]", "rl.judge_model='null'"]
    for overrides in ([], tricky):
        cfg = load_config(ROOT / path if path else None, overrides)
        ref = OmegaConf.structured(cfg)
        assert config_tree(cfg) == OmegaConf.to_container(ref)
        assert to_yaml(cfg) == OmegaConf.to_yaml(ref)
