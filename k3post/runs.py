"""Run folders: one command at a time, the settings a stage ran with, starting over, broken checkpoints.

Every stage command (`k3post sft`, `rl`, `experts`, `mopd`, `draft`, `demo`) opens its run folder with
`open_run`, which, in this order:

1. checks the command's input files (`check_inputs`: ``model.path``, ``tokenizer.path``, ``sft.train_file``,
   ``rl.init``, ``draft.target``, ``draft.mtp``, ``mopd.experts``) and the settings against those the stage
   ran with before (``<run>/stages.json``): a key of `STAGES` [stage] that changed (other than `FREE_KEYS`)
   is a `UserError` listing each key, old → new, before anything is written (a key only one side has, a
   field another k3post version added, is not compared). ``run.restart=true`` instead moves the old run
   (sft, demo: what later stages built on it is stale too) or the stage's folder (rl, experts, mopd, draft)
   to ``<folder>.restart-N/`` (nothing is deleted) and starts afresh;
2. creates the folder and locks it: ``<run>/.k3post.lock`` (flock) holds the pid of the command writing it;
   a second command on the same folder is a `UserError` naming that pid (exit 2);
3. checks every checkpoint folder of the stage (`k3post.checkpoint.broken_checkpoint`): an incomplete one
   is a `BrokenCheckpointError` naming it and the newest intact one, or, with
   ``run.on_broken_checkpoint=fallback``, is moved aside to ``checkpoints/broken-step-N/`` with a warning and
   the stage resumes from the newest intact one;
4. records the stage's settings in ``stages.json``, writes the resolved ``config.yaml`` (the last command's)
   and sends the log to ``k3post.log``, where (and in ``threads.json``) the thread plan the command runs under
   is recorded (`k3post.threads.record_plan`).

The lock is released when the command ends (`release_runs`, called by the CLI) or the process exits.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sys
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from k3post.config import K3Config, config_tree, to_yaml
from k3post.errors import UserError, attach_run_log
from k3post.io import atomic_write
from k3post.spec.layout import draft_aux_layers, draft_target
from k3post.threads import record_plan
from k3post.urls import is_url

__all__ = ["STAGES", "FREE_KEYS", "LOCK", "RECORD", "open_run", "check_inputs", "changed_keys", "release_runs",
           "stage_id", "RunInUse", "RunSummary"]

log = logging.getLogger("k3post.runs")

LOCK = ".k3post.lock"
RECORD = "stages.json"

STAGES: dict[str, tuple[str, ...]] = {
    "pretrain": ("run.seed", "tokenizer", "model", "data.corpus_per_family", "data.eval_family", "pretrain"),
    "sft": ("run.seed", "tokenizer", "model", "data", "sft", "qat"),
    "rl": ("run.seed", "rl", "qat"),
    "experts": ("run.seed", "rl", "qat"),
    "mopd": ("run.seed", "rl", "mopd", "qat"),
    "draft": ("run.seed", "draft", "qat"),
    "demo": ("",),  # every key: the demo runs every stage into one folder
}
"""Stage → the config keys (dotted prefixes) whose values its results depend on."""

FREE_KEYS: tuple[str, ...] = (
    "run.root", "run.name", "run.overwrite", "run.restart", "run.on_broken_checkpoint",
    "distributed.*",  # where it runs: checkpoints resume on any number of ranks
    "sandbox.*",
    "*.progress", "*.log_every", "*.save_every", "*.keep_last",
    "pretrain.cache", "pretrain.cache_dir", "pretrain.probe_*",  # where the base is kept, what is probed
)
"""Keys (fnmatch patterns) that may change between a stage's runs: logging, progress, checkpoint cadence."""

_held: dict[Path, int] = {}  # resolved run folder → the fd holding its lock


class RunSummary:
    """``summary.json`` of a run folder, what `k3post report` shows (status, model, each stage's results),
    rewritten atomically on every `update` so a partial run still has a report. The commands of one folder
    share it: each adds its keys to what the earlier ones wrote."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        self.data["status"] = "running"

    def update(self, **kw: Any) -> None:
        self.data.update(kw)
        atomic_write(self.path, json.dumps(self.data, indent=1, ensure_ascii=False))


class RunInUse(UserError):
    """Another process holds the run folder's lock."""


def stage_id(cfg: K3Config, stage: str) -> str:
    """The record key of a stage's output: one per RL expert (``rl/<domain>.<effort>``) and draft loss."""
    if stage == "rl":
        return f"rl/{cfg.rl.domain}.{cfg.rl.effort}"
    if stage == "draft":
        return f"draft/{cfg.draft.loss}"
    return stage


def _stage_dir(run: Path, cfg: K3Config, stage: str) -> Path:
    return run if stage == "demo" else run / stage_id(cfg, stage)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _settings(cfg: K3Config, stage: str) -> dict[str, Any]:
    """The stage's keys of `STAGES` (less `FREE_KEYS`) → their values, as JSON reads them back."""
    flat = _flatten(config_tree(cfg))
    keep = {k: v for k, v in flat.items() if _relevant(k, stage)}
    return json.loads(json.dumps(keep))


def _relevant(key: str, stage: str) -> bool:
    if any(fnmatch(key, pat) or key == pat for pat in FREE_KEYS):
        return False
    return any(p == "" or key == p or key.startswith(p + ".") for p in STAGES[stage])


def _read_record(run: Path) -> dict[str, Any]:
    path = run / RECORD
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: unreadable ({e}); move it away or start over with run.restart=true") from e
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a mapping of stage settings; move it away or start over with run.restart=true")
    return data


def _previous(run: Path, cfg: K3Config, stage: str) -> dict[str, Any] | None:
    """The settings the stage ran with: its record, else (a run of an older k3post whose stage has output)
    the run's config.yaml."""
    old = _read_record(run).get(stage_id(cfg, stage))
    if old is not None:
        return old
    if (run / "config.yaml").is_file() and _stage_dir(run, cfg, stage).exists():
        import yaml

        try:
            tree = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
        except yaml.YAMLError:
            return None
        flat = _flatten(tree if isinstance(tree, dict) else {})
        return {k: v for k, v in json.loads(json.dumps(flat, default=str)).items() if _relevant(k, stage)}
    return None


def changed_keys(run: Path, cfg: K3Config, stage: str) -> list[str]:
    """``key: old → new`` for each setting of the stage that differs from what it ran with in ``run``."""
    old = _previous(run, cfg, stage)
    if old is None:
        return []
    new = _settings(cfg, stage)
    # a key only one side has is a field another k3post version added or removed, not a setting the user changed
    return [f"{k}: {json.dumps(old[k])} → {json.dumps(new[k])}" for k in sorted(set(old) & set(new)) if old[k] != new[k]]


def _local_path(value: str) -> bool:
    """A setting that names a local path (a hub id such as ``Qwen/Qwen3-8B`` is not one)."""
    return value.startswith((".", "/", "~")) or Path(value).exists()


def check_inputs(cfg: K3Config, stage: str, run: Path | None = None) -> None:
    """A `UserError` naming the key when an input the stage reads is not there (before anything is loaded or
    written)."""
    run = cfg.run.dir if run is None else run

    def model_dir(key: str, value: str, hint: str = "") -> None:
        if not (Path(value).expanduser() / "config.json").is_file():
            raise UserError(f"{key}: {value} is not a model folder (config.json missing){hint}")

    if cfg.tokenizer.path and _local_path(cfg.tokenizer.path) and not Path(cfg.tokenizer.path).expanduser().exists():
        raise UserError(f"tokenizer.path: {cfg.tokenizer.path} does not exist")
    if stage in ("sft", "demo"):
        if cfg.model.path:
            model_dir("model.path", cfg.model.path)
        if cfg.sft.train_file and not Path(cfg.sft.train_file).expanduser().is_file():
            raise UserError(f"sft.train_file: {cfg.sft.train_file}: file not found")
        if cfg.sft.train_file and cfg.sft.on_bad_sample == "error":
            from k3post.data import check_sft_jsonl

            check_sft_jsonl(Path(cfg.sft.train_file).expanduser())  # a bad line: exit 2, nothing written
    if stage in ("rl", "experts", "mopd"):
        model_dir("rl.init", cfg.rl.init or str(run / "sft" / "final"),
                  "" if cfg.rl.init else "; train SFT first or set rl.init")
    if stage == "mopd":
        for name, path in cfg.mopd.experts.items():
            if not is_url(path):  # an endpoint teacher is checked when it is called
                model_dir(f"mopd.experts.{name}", path)
    if stage == "draft":
        target = draft_target(cfg, run)
        layers = json.loads((target / "config.json").read_text()).get("num_hidden_layers")
        if isinstance(layers, int):  # the aux layout is an input error before the run folder is written
            draft_aux_layers(cfg.draft, layers, warn=False)
        if cfg.draft.mtp not in ("", "none") and not Path(cfg.draft.mtp).expanduser().is_dir():
            raise UserError(f"draft.mtp: {cfg.draft.mtp} is not a folder")


def _lock(run: Path) -> None:
    key = run.resolve()
    if key in _held:
        return
    fd = os.open(run / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunInUse(f"{run}: the run folder is in use by another k3post command (pid {holder}); wait for it to "
                       "finish, or choose another run.name") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[key] = fd


def _unlock(run: Path) -> None:
    fd = _held.pop(run.resolve(), None)
    if fd is not None:
        os.close(fd)


def release_runs() -> None:
    """Release every run folder this process locked (the CLI calls it when a command ends)."""
    for key in list(_held):
        os.close(_held.pop(key))


def _move_aside(folder: Path) -> Path:
    """``folder`` → ``<folder>.restart-N`` (the first free N); returns the new path."""
    k = 1
    while (dest := folder.with_name(f"{folder.name}.restart-{k}")).exists():
        k += 1
    folder.rename(dest)
    log.warning("run.restart: moved %s to %s", folder, dest)
    print(f"k3post: run.restart=true: moved {folder} to {dest} (nothing is deleted)", file=sys.stderr)
    return dest


def checkpoint_roots(folder: Path) -> list[Path]:
    """Every ``checkpoints`` folder under ``folder`` (not looking inside checkpoints or data)."""
    out = []
    for dirpath, dirnames, _ in os.walk(folder):
        if Path(dirpath).name == "checkpoints":
            out.append(Path(dirpath))
            dirnames.clear()
        elif len(Path(dirpath).relative_to(folder).parts) >= 4:
            dirnames.clear()
    return sorted(out)


def _check_checkpoints(folder: Path, policy: str) -> None:
    from k3post.checkpoint import broken_checkpoint, fall_back, latest_checkpoint

    for root in checkpoint_roots(folder):
        if broken_checkpoint(root) is None:
            continue
        if policy != "fallback":
            latest_checkpoint(root)  # raises BrokenCheckpointError with the message
        what, _ = broken_checkpoint(root)  # type: ignore[misc]
        intact = fall_back(root)
        msg = f"{what}; run.on_broken_checkpoint=fallback: resuming from {intact} (the broken ones moved to {root}/broken-step-*)"
        log.warning(msg)
        print(f"k3post: warning: {msg}", file=sys.stderr)


def _refuse_changes(run: Path, cfg: K3Config, stage: str) -> None:
    changed = changed_keys(run, cfg, stage)
    if changed:
        where = run.name if stage in ("sft", "demo") else f"{stage_id(cfg, stage)}"
        raise UserError(f"{run}: {stage_id(cfg, stage)} ran with other settings; changed: " + "; ".join(changed)
                        + f". Set them back to resume, choose another run.name, or start over with run.restart=true "
                        f"(moves {where} to {where}.restart-N, nothing is deleted)")


def open_run(run: Path, cfg: K3Config, stage: str) -> Path:
    """Open ``run`` for ``stage`` (module doc): check inputs and settings, start over when asked, lock, check
    checkpoints, record; returns ``run``."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {sorted(STAGES)}")
    run = Path(run)
    check_inputs(cfg, stage, run)
    restart = cfg.run.restart or (stage == "demo" and cfg.run.overwrite)
    if not restart and run.is_dir():
        _refuse_changes(run, cfg, stage)
    whole = stage in ("sft", "demo")  # the first stage: what later stages built on it is stale too
    if restart and whole and run.is_dir() and any(run.iterdir()) and run.resolve() not in _held:
        _lock(run)  # not while another command writes it
        _unlock(run)
        _move_aside(run)
    run.mkdir(parents=True, exist_ok=True)
    _lock(run)
    if not restart:  # again under the lock: another command may have run in between
        _refuse_changes(run, cfg, stage)
    elif not whole and _stage_dir(run, cfg, stage).exists():
        _move_aside(_stage_dir(run, cfg, stage))
    _check_checkpoints(_stage_dir(run, cfg, stage), cfg.run.on_broken_checkpoint)
    record = _read_record(run)
    record[stage_id(cfg, stage)] = _settings(cfg, stage)
    atomic_write(run / RECORD, json.dumps(record, indent=1, sort_keys=True))
    (run / "config.yaml").write_text(to_yaml(cfg))
    attach_run_log(run)
    record_plan(run)
    return run
