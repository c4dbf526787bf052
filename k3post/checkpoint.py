"""Checkpoints: an HF model folder (safetensors + tokenizer) plus ``trainer_state.pt`` for exact resume.

Layout under a stage's folder::

    checkpoints/step-000200/   model.safetensors, config.json, tokenizer files, trainer_state.pt
    checkpoints/latest         text file naming the newest complete checkpoint

A checkpoint is written to a temporary folder and renamed into place, and `latest` is updated last, so a
kill at any moment leaves the previous checkpoint intact and loadable.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save_checkpoint(
    ckpt_root: str | Path, step: int, model: Any, tokenizer: Any, state: dict[str, Any], *, keep: int = 2,
    write_extra: Callable[[Path], Any] | None = None,
) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it, keep the newest `keep` checkpoints.
    `write_extra(folder)` adds files to the checkpoint folder before it is renamed into place. ``model`` None
    writes no HF model folder (a module that is not a `PreTrainedModel` keeps its weights in ``state``)."""
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if model is not None:
        model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if write_extra is not None:
        write_extra(tmp)
    torch.save({**state, "step": step, "rng": rng_state()}, tmp / "trainer_state.pt")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    latest_tmp = root / "latest.tmp"
    latest_tmp.write_text(final.name)
    latest_tmp.replace(root / "latest")
    ckpts = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in ckpts[: max(0, len(ckpts) - keep)]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    root = Path(ckpt_root)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "trainer_state.pt").is_file() else None


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
