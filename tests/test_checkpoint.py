"""Checkpoints (k3post/checkpoint.py) under faults: a kill -9 inside the write (a subprocess stopped at a
chaos pause point and SIGKILLed there), `keep_last` rotation, a full disk (the write raises ENOSPC).
Each leaves `latest` naming a complete checkpoint that loads.

Shape legend: none (whole models only).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from k3post import checkpoint as ck
from k3post.checkpoint import CheckpointWriteError, latest_checkpoint, load_trainer_state, load_weights_into, save_checkpoint
from k3post.models import build_tiny_moe

_TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             moe_intermediate_size=32, num_experts=2, num_experts_per_tok=1, intermediate_size=64)


def _model(seed: int) -> torch.nn.Module:
    return build_tiny_moe(64, seed=seed, **_TINY)


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != "latest")


def _assert_loads(root: Path, step: int, seed: int) -> None:
    """`latest` names step-`step`, whose weights equal `_model(seed)`'s and whose state says `step`."""
    ckpt = latest_checkpoint(root)
    assert ckpt is not None and ckpt.name == f"step-{step:06d}", ckpt
    assert load_trainer_state(ckpt)["step"] == step
    m = _model(999)
    load_weights_into(m, ckpt)
    for (n, p), q in zip(m.named_parameters(), _model(seed).parameters()):
        assert torch.equal(p, q), n


def test_keep_last_bounds_the_folders_and_deletes_only_after_the_new_one_is_complete(tmp_path, monkeypatch):
    """keep_last=2 over 5 saves: at most 2 step folders (+ `latest`) at any time; the rotation runs after
    `latest` names the new checkpoint (seen from inside `_rotate`); a stray later step left by a killed run
    and a killed write's temp folder are removed."""
    root = tmp_path / "ckpt"
    seen = []
    rotate = ck._rotate

    def spy(r, newest, keep_last):
        seen.append((latest_checkpoint(r), sorted(p.name for p in r.glob("step-*"))))
        rotate(r, newest, keep_last)

    monkeypatch.setattr(ck, "_rotate", spy)
    for step in range(1, 6):
        save_checkpoint(root, step, None, None, {"x": step}, keep_last=2)
        assert _steps(root) == [f"step-{s:06d}" for s in range(max(1, step - 1), step + 1)]
    assert [c.name for c, _ in seen] == [f"step-{s:06d}" for s in range(1, 6)]  # the new one was complete first
    assert seen[-1][1] == ["step-000003", "step-000004", "step-000005"]  # 3 on disk only during the rotation

    (root / "step-000009").mkdir()  # a killed run got further, then resumed from an earlier checkpoint
    (root / ".tmp-step-000007").mkdir()  # a write killed half-way
    save_checkpoint(root, 6, None, None, {"x": 6}, keep_last=1)
    assert _steps(root) == ["step-000006"]
    assert load_trainer_state(latest_checkpoint(root))["x"] == 6


def test_a_resume_finishes_the_cleanup_of_a_run_killed_in_its_rotation(tmp_path, monkeypatch):
    """Killed after `latest` names step 3 but before the rotation (found by bench/chaos.py on RL: the last
    checkpoint of a run, so no later save rotated, and 3 folders stayed with keep_last 2): the resume's
    `latest_checkpoint(keep_last=2)` deletes step 1 and a cut write's temp folder; a plain read changes nothing."""
    root = tmp_path / "ckpt"
    for step in (1, 2):
        save_checkpoint(root, step, None, None, {}, keep_last=2)
    monkeypatch.setattr(ck, "_rotate", lambda *a: None)  # the kill
    save_checkpoint(root, 3, None, None, {}, keep_last=2)
    monkeypatch.undo()
    (root / ".tmp-step-000004").mkdir()
    before = _steps(root)
    assert latest_checkpoint(root).name == "step-000003" and _steps(root) == before
    assert latest_checkpoint(root, keep_last=2).name == "step-000003"
    assert _steps(root) == ["step-000002", "step-000003"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_keep_last_is_validated(bad, tmp_path):
    from k3post.config import load_config
    from k3post.errors import UserError

    with pytest.raises(ValueError, match="keep_last must be an integer >= 1"):
        save_checkpoint(tmp_path, 1, None, None, {}, keep_last=bad)
    if isinstance(bad, int) and not isinstance(bad, bool):
        for key in ("sft", "rl", "draft"):
            with pytest.raises(ValueError, match=f"{key}.keep_last must be an integer >= 1"):
                load_config(None, [f"{key}.keep_last={bad}"])
    with pytest.raises(UserError, match="did you mean 'sft.keep_last'"):
        from k3post.cli import _load

        _load(None, ["sft.keep_checkpoints=3"])


_WORKER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from test_checkpoint import _model
    from k3post.checkpoint import save_checkpoint
    save_checkpoint({root!r}, 1, _model(1), None, {{"x": 1}}, keep_last=1)
    os.environ["K3POST_CHAOS_PAUSE"] = {point!r} + ":600"
    print("writing", flush=True)
    save_checkpoint({root!r}, 2, _model(2), None, {{"x": 2}}, keep_last=1)
""")


@pytest.mark.parametrize("point", ["ckpt.mid_write", "ckpt.before_latest"])
def test_kill_inside_the_write_leaves_the_previous_checkpoint_loadable(point, tmp_path):
    """SIGKILL while step 2 is half written (model files, no trainer_state.pt) or renamed into place but not
    yet named by `latest`: `latest` still names step 1, which loads (weights and state); writing step 2
    again succeeds and cleans up (keep_last=1: one folder)."""
    root = tmp_path / "ckpt"
    code = _WORKER.format(tests=str(Path(__file__).parent), root=str(root), point=point)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        marker = root / (".tmp-step-000002/model.safetensors" if point == "ckpt.mid_write" else "step-000002/trainer_state.pt")
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the writer never reached the pause point"
            time.sleep(0.05)
        time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (root / "step-000002").exists() == (point == "ckpt.before_latest")
    _assert_loads(root, 1, seed=1)
    save_checkpoint(root, 2, _model(2), None, {"x": 2}, keep_last=1)
    assert _steps(root) == ["step-000002"]
    _assert_loads(root, 2, seed=2)


def test_full_disk_is_a_clear_error_and_the_last_checkpoint_stays(tmp_path, monkeypatch):
    """The trainer-state write of step 3 raises ENOSPC: `CheckpointWriteError` names the checkpoints folder,
    the step, the full disk and the intact last checkpoint; no partial folder is left; step 2 loads."""
    root = tmp_path / "ckpt"
    for step in (1, 2):
        save_checkpoint(root, step, _model(step), None, {"x": step}, keep_last=2)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ck.torch, "save", full)
    with pytest.raises(CheckpointWriteError) as ei:
        save_checkpoint(root, 3, _model(3), None, {"x": 3}, keep_last=2)
    msg = str(ei.value)
    assert f"cannot write checkpoint step-000003 into {root}: the disk is full" in msg
    assert f"the last complete checkpoint, {root / 'step-000002'}, is intact" in msg
    assert ei.value.errno == errno.ENOSPC
    assert _steps(root) == ["step-000001", "step-000002"]
    _assert_loads(root, 2, seed=2)


def test_full_disk_in_the_cli_is_one_line_naming_the_folder(tmp_path, monkeypatch, capsys, xtml_tokenizer):
    """`k3post sft` whose second checkpoint hits a full disk (and whose traceback file cannot be written
    either): exit 1, one message naming the checkpoints folder; the first checkpoint loads and a rerun
    resumes from it to the end."""
    from k3post import errors
    from k3post.cli import main
    from k3post.models import save_model
    from test_sft import _records, _write

    tok = xtml_tokenizer
    model_dir = save_model(build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, **_TINY), tmp_path / "m", tok)
    data = _write(tmp_path, _records(4))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: {{root: {tmp_path}, name: r}}\nmodel: {{path: {model_dir}}}\nqat: {{enabled: false}}\n"
                   f"sft: {{train_file: {data}, steps: 4, rows_per_batch: 2, save_every: 2, progress: false}}\n")
    real_save, calls = torch.save, []

    def save(obj, f, *a, **k):
        calls.append(f)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *a, **k)

    def no_traceback(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ck.torch, "save", save)
    monkeypatch.setattr(errors, "write_traceback", no_traceback)
    assert main(["sft", str(cfg)]) == 1
    err = capsys.readouterr().err
    root = tmp_path / "r" / "sft" / "checkpoints"
    assert f"CheckpointWriteError: [Errno 28] cannot write checkpoint step-000004 into {root}: the disk is full" in err
    assert "the traceback could not be written (No space left on device)" in err
    assert latest_checkpoint(root).name == "step-000002"
    monkeypatch.undo()
    assert main(["sft", str(cfg)]) == 0
    assert latest_checkpoint(root).name == "step-000004"
