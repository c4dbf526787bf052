"""``k3post status RUN_DIR``: one screen on a run folder, finished or not, read from what the commands write.

    run runs/my-model: running (k3post rl), 41 s so far
    model: qwen3_moe from runs/my-model/sft/final, 0.05 M params, vocab 413
    stage              step        ETA      last metrics
    sft                4 / 4       done     loss 5.92
    rl/general.max     3 / 5       ~20 s    reward 0.25, pass_rate 0.25, effort_tokens 11.5
    checkpoints
      sft/checkpoints              step-000004
      rl/general.max/checkpoints   step-000002 (rerunning the command resumes from it)

The status and model are ``summary.json``'s (`k3post.runs.RunSummary`); the steps and their times are the
``metrics.jsonl`` rows; a stage's planned steps come from ``config.yaml`` (the last command's settings); the ETA
of an unfinished stage is its remaining steps at the mean time per step of its logged rows (no ETA from fewer
than two rows). Checkpoints: the one each ``checkpoints`` folder's ``latest`` names, or what is broken there
(`k3post.checkpoint.broken_checkpoint`). Nothing is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from k3post.errors import UserError

__all__ = ["status_text"]

_PREFERRED = ("loss", "reward", "pass_rate", "effort_tokens", "opd_reward", "copy_exact_20")


def _planned_steps(cfg: dict[str, Any], stage: str) -> int | None:
    """The steps ``stage`` (a metrics stage name) is set to run, from the run's config.yaml; None if unknown."""
    head = stage.split("/", 1)[0]
    section = {"sft": cfg.get("sft"), "sft_noqat": cfg.get("sft"), "rl": cfg.get("rl"), "pretrain": cfg.get("pretrain"),
               "mopd": (cfg.get("mopd") or {}).get("rl")}.get(head)
    if head.startswith("draft"):
        section = cfg.get("draft")
    steps = (section or {}).get("steps") if isinstance(section, dict) else None
    return int(steps) if isinstance(steps, int) else None


def _metrics(run: Path) -> dict[str, list[dict[str, Any]]]:
    """stage -> (first row, last row, number of rows) of metrics.jsonl, in file order."""
    from k3post.metrics import iter_metrics

    out: dict[str, list[Any]] = {}
    path = run / "metrics.jsonl"
    if not path.is_file():
        return {}
    for row in iter_metrics(path):
        stage = str(row.get("stage"))
        if stage not in out:
            out[stage] = [row, row, 0]
        out[stage][1] = row
        out[stage][2] += 1
    return out


def _fmt_seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _last_values(row: dict[str, Any]) -> str:
    nums = {k: v for k, v in row.items() if k not in ("stage", "step", "time") and isinstance(v, (int, float))
            and not isinstance(v, bool)}
    keys = [k for k in _PREFERRED if k in nums] or sorted(nums)[:4]
    return ", ".join(f"{k} {nums[k]:.4g}" for k in keys[:4])


def status_text(run_dir: str | Path) -> str:
    """The status screen of ``run_dir`` (module doc); a `UserError` when it is not a run folder."""
    from k3post.checkpoint import broken_checkpoint
    from k3post.runs import checkpoint_roots

    run = Path(run_dir)
    if not run.is_dir() or not any((run / f).exists() for f in ("summary.json", "metrics.jsonl", "stages.json")):
        raise UserError(f"{run}: not a run folder (no summary.json, metrics.jsonl or stages.json)")
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    cfg: dict[str, Any] = {}
    if (run / "config.yaml").is_file():
        from k3post.yamlio import read_yaml_mapping

        cfg = read_yaml_mapping(run / "config.yaml")
    state = summary.get("status", "unknown")
    command = f" (k3post {summary['command']})" if summary.get("command") else ""
    wall = f", {_fmt_seconds(summary['wall_s'])}" if isinstance(summary.get("wall_s"), (int, float)) else ""
    lines = [f"run {run}: {state}{command}{wall}"]
    if summary.get("model"):
        lines.append(f"model: {summary['model']}")
    if summary.get("error"):
        lines.append(f"error: {summary['error']}")
    stages = _metrics(run)
    running = state == "running"
    if stages:
        width = max(len("stage"), *(len(s) for s in stages))
        lines.append(f"{'stage':<{width}}  {'step':<11} {'ETA':<8} last metrics")
        for stage, (first, last, n) in stages.items():
            step, planned = int(last.get("step", 0)), _planned_steps(cfg, stage)
            done = planned is not None and step >= planned
            eta = "done" if done else "?"
            if not done and planned is not None and n >= 2 and running:
                per_step = (float(last["time"]) - float(first["time"])) / max(step - int(first.get("step", 0)), 1)
                eta = "~" + _fmt_seconds(per_step * (planned - step))
            elif not done and not running:
                eta = "stopped"
            steps = f"{step} / {planned}" if planned is not None else str(step)
            lines.append(f"{stage:<{width}}  {steps:<11} {eta:<8} {_last_values(last)}")
    roots = checkpoint_roots(run)
    if roots:
        lines.append("checkpoints")
        width = max(len(str(r.relative_to(run))) for r in roots)
        for root in roots:
            broken = broken_checkpoint(root)
            latest = root / "latest"
            if broken is not None:
                what, intact = broken
                note = f"BROKEN: {what}" + (f"; newest intact {intact.name}" if intact is not None else "")
            elif latest.is_file():
                note = latest.read_text().strip()
                if state != "done":
                    note += " (rerunning the command resumes from it)"
            else:
                note = "none yet"
            lines.append(f"  {str(root.relative_to(run)):<{width}}  {note}")
    return "\n".join(lines)
