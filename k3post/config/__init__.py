"""Typed configs: YAML files under ``configs/`` plus dotted command-line overrides.

Each component owns a small typed dataclass in a module of this package (``config/sft.py`` holds
``SFTConfig``, ``config/rl.py`` ``RLConfig``, ``config/rollout.py`` ``EngineConfig`` and ``RolloutConfig``
...; the stage modules re-export them). No module here imports torch or a stage, so loading a config
file loads no model code. This module assembles them into one :class:`K3Config` and loads it with
OmegaConf structured configs, which type-check every value. An unknown or mistyped key is a
``ConfigError`` naming the key, the file it came from and the closest valid key; a value outside its
field's declared range (`k3post.config.ranges`: ``sft.lr >= 0``, ``rl.rollout.lambda_`` in (0, 1], ...) one naming
the key, the range, the value and where it was set.

    cfg = load_config("configs/demo.yaml", ["sft.lr=3e-4", "run.name=try2"])
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf._utils import get_omega_conf_dumper
from omegaconf.errors import OmegaConfBaseException

from k3post.config.data import DataConfig
from k3post.config.distributed import DistributedConfig, FSDPConfig
from k3post.config.draft import DRAFT_LOSSES, DraftConfig
from k3post.config.effort import EffortConfig
from k3post.config.eval import EvalConfig
from k3post.config.model import ModelConfig, TokenizerConfig
from k3post.config.mopd import MOPDConfig
from k3post.config.optim import OptimConfig
from k3post.config.pretrain import PretrainConfig
from k3post.config.quant import QATConfig
from k3post.config.ranges import RangeError, check_ranges, ranged
from k3post.config.loss import LossConfig
from k3post.config.optim import PolicyOptimConfig
from k3post.config.rl import GENERAL_MAX_SETTING, MOVED_KEYS, RLConfig, default_domain_overrides
from k3post.config.rollout import EngineConfig, RolloutConfig
from k3post.config.sandbox import SandboxConfig, apply_sandbox_config
from k3post.config.sft import SFTConfig
from k3post.errors import UserError
from k3post.yamlio import read_yaml_mapping

__all__ = ["ConfigError", "RunConfig", "DemoConfig", "K3Config", "load_config", "config_tree", "to_yaml", "DataConfig", "EffortConfig",
           "EvalConfig", "ModelConfig", "TokenizerConfig", "MOPDConfig", "OptimConfig", "PolicyOptimConfig", "LossConfig",
           "QATConfig", "RLConfig",
           "EngineConfig", "RolloutConfig", "SFTConfig", "DraftConfig", "SandboxConfig", "apply_sandbox_config",
           "DistributedConfig", "FSDPConfig", "PretrainConfig"]


class ConfigError(UserError):
    """A config file or override is invalid (unknown key, wrong type, bad YAML)."""


@dataclass
class RunConfig:
    """Where and how a run writes its outputs."""

    name: str = "demo"  # run folder name under `root`
    root: str = "runs"  # parent folder of all runs
    seed: int = 0  # global seed: data generation, init, shuffling
    overwrite: bool = False  # demo: reuse a finished run's folder (as run.restart) instead of a new `-N` one
    restart: bool = False  # start the stage over: the old run (sft, demo) or stage folder moves to `<folder>.restart-N` (k3post.runs)
    on_broken_checkpoint: str = "error"  # error | fallback: resume from the newest intact checkpoint, the broken ones moved aside
    threads: int = ranged(0, ge=0)  # torch threads the command keeps busy, shared by its concurrent processes (k3post.threads); 0: auto, from the cores this process may use. Pin it to repeat a run's numbers: a matmul's reduction order depends on it

    def __post_init__(self) -> None:
        if self.on_broken_checkpoint not in ("error", "fallback"):
            raise ValueError(f"run.on_broken_checkpoint must be error or fallback, got {self.on_broken_checkpoint!r}")

    @property
    def dir(self) -> Path:
        return Path(self.root) / self.name


DEMO_BASES = ("build", "cached", "none")


@dataclass
class DemoConfig:
    """What `k3post demo` runs besides the pipeline itself."""

    compare_no_qat: bool = True  # also train the same SFT run without QAT and compare held-out pass rate
    drafts: list[str] = field(default_factory=lambda: ["lk_alpha", "kl"])  # EAGLE-3 drafts for the MOPD student, one per loss (draft.*); [] skips the stage
    mtp_weight: float = 0.3  # the demo's SFT runs train an MTP head (as sft.mtp_weight, which is off by default)
    mtp_start_fraction: float = 0.8  # ... from this fraction of sft.steps on (as sft.mtp_start_fraction)
    mtp_lr_scale: float = 5.0  # ... at this multiple of the SFT schedule's learning rate (as sft.mtp_lr_scale): a head switched on late, on the frozen trunk, learns in its last 20 % of the steps (measured at 400 of 2,000; docs/decisions.md, issue 31 §mtp)
    # stage 0 (k3post.stages.pretrain): build = use the cached base of the run's settings, building it (once) when missing;
    # cached = use it when cached, else start from random weights (and say so); none = random weights. The demo's
    # default is cached: building its base costs ~13 min of one core, beyond the demo's 15-minute budget, and
    # whether it helps post-training was not measured yet (docs/decisions.md, Issue 31 §base)
    base: str = "cached"

    def __post_init__(self) -> None:
        if self.base not in DEMO_BASES:
            raise ValueError(f"demo.base must be one of {list(DEMO_BASES)}, got {self.base!r}")
        bad = [x for x in self.drafts if x not in DRAFT_LOSSES]
        if bad:
            raise ValueError(f"demo.drafts: unknown draft losses {bad}; expected some of {DRAFT_LOSSES}")
        if self.mtp_weight < 0:
            raise ValueError(f"demo.mtp_weight must be >= 0, got {self.mtp_weight}")
        if not 0 <= self.mtp_start_fraction < 1:
            raise ValueError(f"demo.mtp_start_fraction must be in [0, 1), got {self.mtp_start_fraction}")
        if not self.mtp_lr_scale > 0:
            raise ValueError(f"demo.mtp_lr_scale must be > 0, got {self.mtp_lr_scale}")


@dataclass
class K3Config:
    """The whole pipeline's config: one section per component."""

    run: RunConfig = field(default_factory=RunConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    qat: QATConfig = field(default_factory=QATConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rl: RLConfig = field(default_factory=lambda: RLConfig(domain_overrides={**default_domain_overrides(), **GENERAL_MAX_SETTING}))
    mopd: MOPDConfig = field(default_factory=MOPDConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


def _field_types(cls: type, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, resolved type) of every field of a dataclass tree, sections before their fields."""
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}{f.name}"
        ftype = f.type if not isinstance(f.type, str) else _type_hints(cls)[f.name]
        yield dotted, ftype
        if dataclasses.is_dataclass(ftype):
            yield from _field_types(ftype, dotted + ".")


# The config classes do not change while the program runs, so what is read off their fields is read once per
# class: resolving the string annotations (``from __future__ import annotations``) of every field through
# `typing.get_type_hints` was half of a `load_config` call (0.17 s), which every command and many tests make.


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _valid_keys(cls: type) -> Mapping[str, type | None]:
    """All dotted keys of a dataclass tree → the dataclass type of a section (None for leaves); read-only."""
    return MappingProxyType({k: (t if dataclasses.is_dataclass(t) else None) for k, t in _field_types(cls)})


def _check_keys(tree: Any, valid: Mapping[str, type | None], source: str, prefix: str = "") -> None:
    if not isinstance(tree, dict):
        return
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if dotted not in valid and valid.get(prefix[:-1]) is RLConfig and key in MOVED_KEYS:
            raise ConfigError(f"{source}: '{dotted}' is now '{prefix}{MOVED_KEYS[key]}' (an RL stage's rollout, "
                              "optimizer and loss settings have sections of their own)")
        if dotted not in valid:
            siblings = [k for k in valid if k.rsplit(".", 1)[0] == dotted.rsplit(".", 1)[0] or "." not in k]
            section = [k for k in valid if "." in dotted and k.rsplit(".", 1)[0] == dotted.rsplit(".", 1)[0]]
            close = (difflib.get_close_matches(dotted, section, n=1, cutoff=0.5)  # its own section's first
                     or difflib.get_close_matches(dotted, list(valid), n=1, cutoff=0.5)
                     or difflib.get_close_matches(dotted, siblings, n=1, cutoff=0.0))
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{source}: unknown config key '{dotted}'{hint}")
        if valid[dotted] is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: '{dotted}' is a section; give it a mapping, not {value!r}")
            _check_keys(value, valid, source, dotted + ".")


@functools.cache
def _flat_mappings(cls: type) -> frozenset[str]:
    """Dotted keys of the dict fields whose values are not mappings (``data.family_tasks``,
    ``mopd.experts``): their own keys may contain dots (family and expert names)."""
    out: set[str] = set()
    for dotted, ftype in _field_types(cls):
        if typing.get_origin(ftype) is dict:
            value = typing.get_args(ftype)[1] if typing.get_args(ftype) else Any
            if typing.get_origin(value) is not dict and value is not dict:
                out.add(dotted)
    return frozenset(out)


def _dotlist_tree(overrides: Sequence[str]) -> list[tuple[str, dict]]:
    """``KEY=VALUE`` overrides → nested mappings. Under a flat mapping field the rest of the key is one
    entry: ``data.family_tasks.coding.write_function=100`` sets the entry ``coding.write_function``."""
    flat = _flat_mappings(K3Config)
    trees = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected KEY=VALUE, e.g. sft.lr=3e-4")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else ""
        node: dict = {}
        cur = node
        parts = key.strip().split(".")
        for i in range(1, len(parts)):
            if ".".join(parts[:i]) in flat:
                parts = [*parts[:i], ".".join(parts[i:])]
                break
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = value
        trees.append((item, node))
    return trees


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> K3Config:
    """Load defaults ← YAML file ← dotted overrides into a typed :class:`K3Config`.

    Raises ConfigError naming the file (or override) and key for unknown keys, wrong types, values outside
    their range and bad YAML.
    """
    valid = _valid_keys(K3Config)
    merged = OmegaConf.structured(K3Config)
    layers: list[tuple[str, Any]] = []
    if path is not None:
        layers.append((str(path), read_yaml_mapping(path, "config file", ConfigError)))
    layers.extend((f"override '{item}'", tree) for item, tree in _dotlist_tree(overrides))
    for source, tree in layers:
        _check_keys(tree, valid, source)
        try:  # in place: `OmegaConf.merge` would deep-copy the whole config once per layer (~15 ms an override)
            merged.merge_with(OmegaConf.create(tree))
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None) or ""
            raise ConfigError(f"{source}: bad value for '{key}': {e.msg if hasattr(e, 'msg') else e}") from e
    try:
        obj = OmegaConf.to_object(merged)
    except ValueError as e:  # a section's own check names its key within the section: name the whole key
        raise ValueError(_whole_key(str(e), layers)) from None
    assert isinstance(obj, K3Config)
    try:
        check_ranges(obj)
    except RangeError as e:
        where = next((source for source, tree in reversed(layers) if _sets(tree, e.key)), "the defaults")
        raise ConfigError(f"{where}: {e}") from None
    return obj


def _whole_key(message: str, layers: Sequence[tuple[str, Any]]) -> str:
    """``message`` of a config section's check (``rollout.exact=true needs ...``, the key as the section knows it)
    with that key as the layers set it (``rl.rollout.exact``; the last layer that sets a key ending so)."""
    head = message.split(" ", 1)[0].split("=", 1)[0].rstrip(":")
    if "." not in head:
        return message
    for _, tree in reversed(layers):
        for key in _dotted_keys(tree):
            if key.endswith("." + head):
                return key[: -len(head)] + message
    return message


def _dotted_keys(tree: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield f"{prefix}{k}"
            yield from _dotted_keys(v, f"{prefix}{k}.")


def _sets(tree: Any, dotted: str) -> bool:
    """True when the mapping ``tree`` holds the dotted key."""
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def config_tree(cfg: Any) -> Any:
    """A loaded config (or any section of it) as plain values: dicts in field order, lists (for lists and
    tuples), enum names and scalars, as ``OmegaConf.to_container`` gives them. Read straight off the dataclasses:
    OmegaConf builds and deep-copies a node per value (~70 ms a config), every command did it twice (the run's
    ``config.yaml``, the settings `k3post.runs` records) and a test file of commands several times over."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: config_tree(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Mapping):
        return {k: config_tree(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [config_tree(v) for v in cfg]
    if isinstance(cfg, enum.Enum):
        return cfg.name
    return cfg


def to_yaml(cfg: K3Config) -> str:
    """The resolved config as YAML (written into every run folder): OmegaConf's YAML of it, byte for byte
    (tests/test_config.py), from `config_tree`."""
    return yaml.dump(config_tree(cfg), Dumper=get_omega_conf_dumper(), default_flow_style=False, allow_unicode=True,
                     sort_keys=False)
