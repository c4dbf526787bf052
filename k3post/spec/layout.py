"""Which model `k3post draft` drafts for and which of its layers the draft reads: resolved from the config and
the target's folder, before anything is loaded or written (`k3post.runs.check_inputs`) and again where the
draft is built (`k3post.recipes.commands.train_drafts`, which the demo reaches without the run-folder checks)."""

from __future__ import annotations

import logging
from pathlib import Path

from k3post.config import K3Config
from k3post.config.draft import DraftConfig
from k3post.errors import UserError

__all__ = ["draft_aux_layers", "draft_target"]

log = logging.getLogger("k3post.commands")


def draft_target(cfg: K3Config, run: Path) -> Path:
    """The model `k3post draft` drafts for: ``draft.target``, else the run's MOPD student, else its SFT model."""
    candidates = [Path(cfg.draft.target)] if cfg.draft.target else [run / "mopd" / "final", run / "sft" / "final"]
    for c in candidates:
        if (c / "config.json").is_file():
            return c
    raise UserError(f"draft.target: none of {[str(c) for c in candidates]} is a model folder (config.json missing); "
                    "train the pipeline first or set draft.target")


def draft_aux_layers(d: DraftConfig, num_layers: int, *, warn: bool = True) -> tuple[int, int, int]:
    """The aux layer ids of a draft for an ``num_layers``-layer target: ``draft.aux_layers``, else
    ``stock_aux_layers``. A UserError (exit 2) for ids outside 0..L, and for ids stock vLLM / SGLang cannot
    record (``engine_capturable``) unless ``draft.nonstock_export``."""
    from k3post.spec.eagle3 import engine_capturable, stock_aux_layers
    from k3post.spec.export import nonstock_message

    if not d.aux_layers:
        try:
            return stock_aux_layers(num_layers)
        except ValueError as e:
            raise UserError(f"draft.aux_layers: {e}; set draft.aux_layers and draft.nonstock_export=true for "
                            "k3post's own engine") from None
    aux = tuple(int(i) for i in d.aux_layers)
    if not all(0 <= i <= num_layers for i in aux):
        raise UserError(f"draft.aux_layers={list(aux)}: ids must be in 0..{num_layers} for this {num_layers}-layer target")
    if not engine_capturable(aux, num_layers) and not d.nonstock_export:
        stock = f"the default {list(stock_aux_layers(num_layers))}" if num_layers >= 4 else "a target of 4+ layers"
        raise UserError(f"draft.aux_layers={list(aux)}: {nonstock_message(aux, num_layers)}. Use {stock}, or set "
                        "draft.nonstock_export=true to train and export it anyway for an engine that records those "
                        "states (k3post's own engine does, except id 0)")
    if warn and not engine_capturable(aux, num_layers):
        log.warning("draft.aux_layers=%s with draft.nonstock_export=true: %s", list(aux), nonstock_message(aux, num_layers))
    return aux  # type: ignore[return-value]
