"""Checkpoints: an HF model folder (safetensors + tokenizer) plus ``trainer_state.pt`` for exact resume.

Layout under a stage's folder::

    checkpoints/step-000200/   model.safetensors, config.json, tokenizer files, trainer_state.pt
    checkpoints/latest         text file naming the newest complete checkpoint

A sharded trainer (`k3post.distributed.fsdp.FSDPTrainer`) writes no HF model folder: its weights and
optimizer are a ``dcp/`` folder (torch.distributed.checkpoint, keyed by parameter name) beside
``trainer_state.pt``, which `load_dcp` reads on any number of ranks, one process included.

A checkpoint is written to a temporary folder, fsynced and renamed into place, `latest` is updated after it,
and older checkpoints are deleted only then (``keep_last`` of them stay), so a kill at any moment leaves
`latest` naming a complete checkpoint (tests/test_checkpoint.py kills inside the write; bench/chaos.py kills
each stage at random points).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from k3post.config.optim import check_keep_last


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a quota, a lost mount). The message names the folder,
    the step and the last complete checkpoint, which is left intact."""


def _step_of(folder: Path) -> int:
    return int(folder.name.split("-", 1)[1])


def fsync_path(path: Path) -> None:
    """fsync one file or folder (a folder: its entries, so a rename into it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """fsync every file under ``folder`` and the folders themselves (a power cut after the rename then
    finds whole files; a SIGKILL alone loses nothing the kernel already holds)."""
    for f in sorted(folder.rglob("*"), reverse=True):
        fsync_path(f)
    fsync_path(folder)


def _chaos_pause(point: str) -> None:
    """Tests of kill -9 (tests/test_checkpoint.py, bench/chaos.py) stop a write in the middle:
    ``K3POST_CHAOS_PAUSE=<point>:<seconds>`` sleeps there. Points: ``ckpt.mid_write`` (the model files are
    written, ``trainer_state.pt`` is not) and ``ckpt.before_latest`` (renamed into place, ``latest`` not yet
    moved)."""
    spec = os.environ.get("K3POST_CHAOS_PAUSE", "")
    name, _, seconds = spec.partition(":")
    if name == point:
        time.sleep(float(seconds or 3600))


def save_checkpoint(
    ckpt_root: str | Path, step: int, model: Any, tokenizer: Any, state: dict[str, Any], *, keep_last: int = 2,
    write_extra: Callable[[Path], Any] | None = None,
) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it, then keep the newest `keep_last` checkpoints.
    `write_extra(folder)` adds files to the checkpoint folder before it is renamed into place. ``model`` None
    writes no HF model folder (a module that is not a `PreTrainedModel` keeps its weights in ``state``).

    Order: every file into ``.tmp-step-N`` (fsynced), rename to ``step-N``, write ``latest.tmp`` and rename
    it over ``latest``, and only then delete older checkpoints, so a kill at any point leaves ``latest``
    naming a complete checkpoint. A write that fails for lack of space (or any other OSError) removes the
    partial folder and raises `CheckpointWriteError` naming the folder and the last complete checkpoint."""
    check_keep_last(keep_last, "keep_last")
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    for stale in root.glob(".tmp-step-*"):  # a killed write's leftovers (one writer per folder)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        if model is not None:
            model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if write_extra is not None:
            write_extra(tmp)
        _chaos_pause("ckpt.mid_write")
        torch.save({**state, "step": step, "rng": rng_state()}, tmp / "trainer_state.pt")
        _fsync_tree(tmp)
        if final.exists():  # a killed run wrote this step but never pointed `latest` at it: replaced
            shutil.rmtree(final)
        tmp.rename(final)
        _chaos_pause("ckpt.before_latest")
        latest_tmp = root / "latest.tmp"
        with latest_tmp.open("w") as fh:
            fh.write(final.name)
            fh.flush()
            os.fsync(fh.fileno())
        latest_tmp.replace(root / "latest")
        fsync_path(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        last = latest_checkpoint(root)
        why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "the write failed"
        raise CheckpointWriteError(
            e.errno, f"cannot write checkpoint {final.name} into {root}: {why} ({e.strerror or e}); "
            + (f"the last complete checkpoint, {last}, is intact and a rerun resumes from it"
               if last is not None else "no earlier checkpoint exists") + "; free space and run the command again",
        ) from e
    _rotate(root, final, keep_last)
    return final


def _rotate(root: Path, newest: Path, keep_last: int) -> None:
    """Delete every complete checkpoint but the ``keep_last`` newest up to ``newest`` (which `latest` names);
    a folder of a later step (left by a killed run that resumed from an earlier checkpoint) goes too."""
    step = _step_of(newest)
    ckpts = sorted((p for p in root.glob("step-*") if p.is_dir()), key=_step_of)
    kept = [p for p in ckpts if _step_of(p) <= step][-keep_last:]
    for old in ckpts:
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(ckpt_root: str | Path, *, keep_last: int | None = None) -> Path | None:
    """The newest complete checkpoint folder, or None. With ``keep_last`` (a run about to resume) it also
    finishes the cleanup a killed run left: temp folders of a cut write and the checkpoints beyond
    ``keep_last`` a kill during the rotation left (without another save they would stay)."""
    root = Path(ckpt_root)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "trainer_state.pt").is_file():
        return None
    if keep_last is not None:
        for stale in root.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)
        _rotate(root, path, keep_last)
    return path


def load_trainer_state(ckpt: str | Path) -> dict[str, Any]:
    return torch.load(Path(ckpt) / "trainer_state.pt", weights_only=False)


def load_weights_into(model: torch.nn.Module, ckpt: str | Path) -> None:
    """Copy a checkpoint's weights into an existing model, strictly (every tensor must match).

    The folder is read through ``from_pretrained`` because transformers may store weights in a
    different layout than it holds them in memory (fused MoE experts are saved per expert).
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        loaded, info = AutoModelForCausalLM.from_pretrained(
            Path(ckpt), dtype=next(model.parameters()).dtype, local_files_only=True, output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below, by name
        )
    except (OSError, RuntimeError, ValueError, SafetensorError) as e:  # a truncated file, no weights file
        raise ValueError(f"{ckpt}: cannot load the checkpoint's weights: {str(e).strip().splitlines()[-1]}") from e
    # from_pretrained fills a tensor the files lack with fresh random values and drops one the model lacks:
    # both are a broken checkpoint here, never a silent re-initialisation (issue 20)
    missing, unexpected = sorted(info.get("missing_keys") or []), sorted(info.get("unexpected_keys") or [])
    if missing or unexpected:
        raise ValueError(f"{ckpt}: weights do not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})")
    mismatched = sorted(info.get("mismatched_keys") or [])  # (key, shape in the files, shape in the model)
    if mismatched:
        key, got, want = mismatched[0]
        raise ValueError(f"{ckpt}: tensor {key} has shape {tuple(got)}, the model expects {tuple(want)}")
    src = loaded.state_dict()
    dst = model.state_dict()
    if set(src) != set(dst):
        missing, unexpected = sorted(set(dst) - set(src)), sorted(set(src) - set(dst))
        raise ValueError(f"{ckpt}: weights do not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})")
    for k, v in dst.items():  # every shape checked before any copy: a refused checkpoint leaves the model as it was
        if v.shape != src[k].shape:
            raise ValueError(f"{ckpt}: tensor {k} has shape {tuple(src[k].shape)}, the model expects {tuple(v.shape)}")
    with torch.no_grad():
        for k, v in dst.items():
            v.copy_(src[k])


def load_dcp(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str | Path) -> None:
    """Load a ``dcp/`` folder (weights and optimizer, keyed by parameter name, written by any number of ranks)
    into ``model`` and ``optimizer``, sharded or not: each process reads the slices it holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    sd = {"model": msd, "optimizer": osd}
    dcp.load(sd, checkpoint_id=Path(folder))
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
