"""Checkpoints: an HF model folder (safetensors + tokenizer) plus ``trainer_state.pt`` for exact resume.

Layout under a stage's folder::

    checkpoints/step-000200/   model.safetensors, config.json, tokenizer files, trainer_state.pt, manifest.json
    checkpoints/latest         text file naming the newest complete checkpoint
    checkpoints/broken-step-N/ an incomplete checkpoint moved aside by ``run.on_broken_checkpoint=fallback``

``manifest.json``, written last, lists every file of the checkpoint with its size, so a checkpoint is
complete (`checkpoint_problem`) when each listed file is there at that size. A resume reads the folder as
`latest` says: when `latest` names an incomplete checkpoint (or names none while step folders exist and the
newest is incomplete) `latest_checkpoint` raises `BrokenCheckpointError` naming it and the newest intact one,
rather than starting again from step 0 (which truncated the metrics and rotated away the good checkpoints);
`fall_back` moves the broken ones aside and points `latest` at the newest intact one. ``trainer_state.pt``
holds tensors and plain data only and loads with ``torch.load(weights_only=True)``; a ``dcp/`` folder's
pickled metadata loads through an allow-list unpickler (`load_dcp`), so a planted file runs no code.

A sharded trainer (`k3post.trainer.fsdp.FSDPTrainer`) writes no HF model folder: its weights and
optimizer are a ``dcp/`` folder (torch.distributed.checkpoint, keyed by parameter name) beside
``trainer_state.pt``, which `load_dcp` reads on any number of ranks, one process included.

A checkpoint is written to a temporary folder, fsynced and renamed into place, `latest` is updated after it,
and older checkpoints are deleted only then (``keep_last`` of them stay), so a kill at any moment leaves
`latest` naming a complete checkpoint (tests/test_checkpoint.py kills inside the write; bench/chaos.py kills
each stage at random points).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from k3post.config.optim import check_keep_last
from k3post.errors import UserError
from k3post.io import atomic_write, fsync_path

log = logging.getLogger("k3post.checkpoint")


MANIFEST = "manifest.json"
"""The file listing a checkpoint's files and sizes, written last (`checkpoint_problem` checks it)."""


def rng_state() -> dict[str, Any]:
    """The RNG states as tensors and plain data (``torch.load(weights_only=True)`` reads them back)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)}}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    npy = state["numpy"]
    if isinstance(npy, dict):
        npy = (npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"])
    np.random.set_state(npy)  # a tuple: a checkpoint of an older k3post


class BrokenCheckpointError(UserError):
    """The checkpoint `latest` names (or the newest one, without `latest`) is incomplete; the message names it
    and the newest intact checkpoint."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a quota, a lost mount). The message names the folder,
    the step and the last complete checkpoint, which is left intact."""


def checkpoint_step(folder: Path) -> int:
    """The step of a ``step-N`` checkpoint folder."""
    return int(folder.name.split("-", 1)[1])


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

    Order: every file into ``.tmp-step-N`` (fsynced), rename to ``step-N``, write ``latest`` atomically
    (`k3post.io.atomic_write`), and only then delete older checkpoints, so a kill at any point leaves ``latest``
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
        _write_manifest(tmp, step)
        _fsync_tree(tmp)
        if final.exists():  # a killed run wrote this step but never pointed `latest` at it: replaced
            shutil.rmtree(final)
        tmp.rename(final)
        _chaos_pause("ckpt.before_latest")
        _point_latest(root, final)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)  # the partial folder; `latest` and the checkpoints before it stay
        full = disk_full(e)
        if not full and not isinstance(e, OSError):
            raise
        try:
            last = latest_checkpoint(root)
        except BrokenCheckpointError:
            last = None
        code = errno.ENOSPC if full else getattr(e, "errno", None)
        why = f"the disk is full: no space left on {root}" if full else f"the write failed ({getattr(e, 'strerror', None) or e})"
        raise CheckpointWriteError(
            code, f"cannot write checkpoint {final.name} into {root}: {why}; "
            + (f"the last complete checkpoint, {last}, is intact and a rerun resumes from it"
               if last is not None else "no earlier checkpoint exists") + "; free space and run the command again",
        ) from e
    _rotate(root, final, keep_last)
    return final


_FULL_DISK_TEXT = ("No space left on device", "StorageFull", "Disk quota exceeded", "QuotaExceeded")
"""How a full disk reads in the errors that carry no errno: safetensors' (a Rust IoError in the message)."""


def disk_full(e: BaseException) -> bool:
    """Whether a failed write ran out of space: an OSError with ENOSPC / EDQUOT, safetensors' error saying so,
    or torch.save's zip writer stopping short (``[enforce fail at inline_container.cc] ... unexpected pos``, or
    ``PytorchStreamWriter failed writing file``: the bytes it wrote are fewer than it asked for, which on a
    local disk is a full one; torch gives no errno)."""
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(e)
    return any(t in text for t in _FULL_DISK_TEXT) or ("inline_container" in text and "unexpected pos" in text) \
        or "PytorchStreamWriter failed writing file" in text


def _rotate(root: Path, newest: Path, keep_last: int) -> None:
    """Delete every complete checkpoint but the ``keep_last`` newest up to ``newest`` (which `latest` names);
    a folder of a later step (left by a killed run that resumed from an earlier checkpoint) goes too."""
    step = checkpoint_step(newest)
    ckpts = sorted((p for p in root.glob("step-*") if p.is_dir()), key=checkpoint_step)
    kept = [p for p in ckpts if checkpoint_step(p) <= step][-keep_last:]
    for old in ckpts:
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)


def _write_manifest(folder: Path, step: int) -> None:
    files = {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*")) if f.is_file()}
    (folder / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=0))


def checkpoint_problem(folder: str | Path) -> str | None:
    """None when ``folder`` is a complete checkpoint: every file its ``manifest.json`` lists is there at the
    listed size (a checkpoint of an older k3post, without a manifest: ``trainer_state.pt`` is there); else
    what is wrong, in words."""
    folder = Path(folder)
    if not folder.is_dir():
        return "the folder does not exist"
    if not (folder / "trainer_state.pt").is_file():
        return "trainer_state.pt is missing"
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None  # written before manifests: trainer_state.pt, written last, is the only completeness mark
    try:
        files = json.loads(manifest.read_text())["files"]
        listed = {str(k): int(v) for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for name, size in listed.items():
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {MANIFEST} says {size}"
    return None


def _step_folders(root: Path) -> list[Path]:
    return sorted((p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()), key=checkpoint_step)


def intact_checkpoints(root: str | Path) -> list[Path]:
    """The complete step checkpoints under ``root`` (`checkpoint_problem` finds nothing wrong), oldest first."""
    return [p for p in _step_folders(Path(root)) if checkpoint_problem(p) is None]


def _newest_intact(root: Path) -> Path | None:
    intact = intact_checkpoints(root)
    return intact[-1] if intact else None


def broken_checkpoint(ckpt_root: str | Path) -> tuple[str, Path | None] | None:
    """None when ``ckpt_root`` can be resumed as it says (no checkpoint at all, or `latest` names a complete
    one); else (what is broken, the newest intact checkpoint or None). Without `latest` the newest step folder
    is what the folder says, when complete (a kill between its rename and the write of `latest`)."""
    root = Path(ckpt_root)
    pointer = root / "latest"
    steps = _step_folders(root)
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        problem = checkpoint_problem(named)
        if problem is None:
            return None
        return f"{named}, which {pointer} names, is incomplete: {problem}", _newest_intact(root)
    if not steps:
        return None
    problem = "its manifest is missing" if not (steps[-1] / MANIFEST).is_file() else checkpoint_problem(steps[-1])
    if problem is None:
        return None
    return f"{pointer} is missing and the newest checkpoint, {steps[-1]}, is incomplete: {problem}", _newest_intact(root)


@contextmanager
def resuming(ckpt: str | Path) -> Iterator[None]:
    """Around loading checkpoint ``ckpt`` to resume from it. Its files can all be there at the sizes its manifest
    lists and still not load (damaged contents: a disk error, a file rewritten in place); when an older
    complete checkpoint exists, that failure is a `BrokenCheckpointError` naming both and how to resume from
    the older one. Otherwise (none older, or a refusal that is already the user's) the error is raised as it was."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        ckpt = Path(ckpt)
        older = next((p for p in reversed(_step_folders(ckpt.parent))
                      if checkpoint_step(p) < checkpoint_step(ckpt) and checkpoint_problem(p) is None), None)
        if older is None:
            raise
        why = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        raise BrokenCheckpointError(
            f"{ckpt} cannot be loaded ({type(e).__name__}: {why}), although its files have the sizes its {MANIFEST} "
            f"lists; the newest older complete checkpoint is {older}: to resume from it, move {ckpt} aside (e.g. to "
            f"{ckpt.parent / ('broken-' + ckpt.name)}) and run again with run.on_broken_checkpoint=fallback; "
            "run.restart=true starts over (the old run is moved aside)") from e


def _point_latest(root: Path, folder: Path) -> None:
    atomic_write(root / "latest", folder.name)


def fall_back(ckpt_root: str | Path) -> Path:
    """Resume from the newest intact checkpoint of a broken ``ckpt_root`` (`broken_checkpoint`): every step
    folder after it moves to ``broken-step-N`` (nothing is deleted) and `latest` names it. Returns it; a
    `BrokenCheckpointError` when there is none."""
    root = Path(ckpt_root)
    found = broken_checkpoint(root)
    if found is None:
        raise ValueError(f"{root}: no broken checkpoint to fall back from")
    what, intact = found
    if intact is None:
        raise BrokenCheckpointError(f"{what}; no intact checkpoint to fall back to: move the folder away or start "
                                    "over with run.restart=true (the old run is moved aside, not deleted)")
    for p in _step_folders(root):
        if checkpoint_step(p) > checkpoint_step(intact):
            dest, k = root / f"broken-{p.name}", 1
            while dest.exists():
                k += 1
                dest = root / f"broken-{p.name}.{k}"
            p.rename(dest)
    _point_latest(root, intact)
    return intact


def latest_checkpoint(ckpt_root: str | Path, *, keep_last: int | None = None) -> Path | None:
    """The checkpoint a run resumes from: the one `latest` names (the newest complete step folder when `latest`
    is missing), or None when there is none. An incomplete one is a `BrokenCheckpointError` naming it and the
    newest intact checkpoint, never None (a run would start again from step 0 and rotate the good ones away).
    With ``keep_last`` (a run about to resume) it also finishes the cleanup a killed run left: temp folders of
    a cut write and the checkpoints beyond ``keep_last`` a kill during the rotation left (without another save
    they would stay)."""
    root = Path(ckpt_root)
    found = broken_checkpoint(root)
    if found is not None:
        what, intact = found
        raise BrokenCheckpointError(
            f"{what}; " + (f"the newest intact checkpoint is {intact}: run.on_broken_checkpoint=fallback resumes "
                           "from it (the broken ones are moved aside)" if intact is not None else
                           "no intact checkpoint is left") + ", run.restart=true starts over (the old run is moved aside)")
    steps = _step_folders(root)
    if not (root / "latest").is_file():
        if not steps:
            return None
        path = steps[-1]
        log.warning("%s: `latest` is missing; resuming from the newest checkpoint, %s, which is complete", root, path)
    else:
        path = root / (root / "latest").read_text().strip()
    if keep_last is not None:
        for stale in root.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)
        _rotate(root, path, keep_last)
    return path


def _legacy_safe_globals() -> list[Any]:
    """What an older k3post's trainer_state.pt held besides tensors: numpy's RNG state (an ndarray)."""
    multiarray = getattr(np, "_core", None) or np.core
    return [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_trainer_state(ckpt: str | Path) -> dict[str, Any]:
    """``trainer_state.pt`` with ``torch.load(weights_only=True)``: tensors and plain data only, so a planted
    file cannot run code; anything else is a `UserError` naming the file."""
    path = Path(ckpt) / "trainer_state.pt"
    try:
        with torch.serialization.safe_globals(_legacy_safe_globals()):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        first = [ln for ln in str(e).strip().splitlines() if "Unsupported global" in ln]
        if not first:
            raise  # not a pickle at all (a torn or foreign file): a failure, not a refusal
        raise UserError(f"{path}: refused: it holds objects other than tensors and plain data, which a "
                        f"checkpoint of k3post never does ({first[0].split(' Please use')[0].strip()})") from e


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


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` (a pickle) with only the classes DCP writes there: its metadata dataclasses, the
    file reader's storage info, paths, torch dtypes / sizes / layouts. Anything else is refused."""

    _ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                ("pathlib", "PureWindowsPath"), ("torch", "Size"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        elif (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a DCP metadata file")


def _read_metadata(fh: Any, path: Path) -> Any:
    try:
        return _MetadataUnpickler(fh).load()
    except (pickle.UnpicklingError, AttributeError, EOFError, ImportError, ValueError, TypeError) as e:
        raise UserError(f"{path}: refused: not a DCP metadata file ({e})") from e


def _safe_dcp_reader(folder: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as fh:
                metadata = _read_metadata(fh, path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(folder)


def _safe_dcp_planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        """DCP stores non-tensor values (the optimizer's hyperparameters) as torch.save bytes, which the stock
        planner loads with weights_only=False."""

        def load_bytes(self, read_item: Any, value: Any) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:  # as the stock planner does
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner()


def load_dcp(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str | Path) -> None:
    """Load a ``dcp/`` folder (weights and optimizer, keyed by parameter name, written by any number of ranks)
    into ``model`` and ``optimizer``, sharded or not: each process reads the slices it holds. The metadata and
    the non-tensor values load through allow-lists (`_MetadataUnpickler`, ``weights_only=True``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = Path(folder) / ".metadata"
    with meta.open("rb") as fh:  # checked here too: DCP's own wrapping of a reader's error loses the message
        _read_metadata(fh, meta)
    msd, osd = get_state_dict(model, optimizer)
    sd = {"model": msd, "optimizer": osd}
    dcp.load(sd, storage_reader=_safe_dcp_reader(Path(folder)), planner=_safe_dcp_planner())
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
