"""Run folders and checkpoints a user (or an attacker) can break (issue 30 §4, §5): incomplete checkpoints are
an error or a loud fallback, never a silent restart; one command at a time per run folder; a changed config is
refused on resume; input errors exit 2 before anything is written; trainer_state.pt and DCP metadata load
without running code.

Shape legend: none (whole models only).
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch

from k3post import checkpoint as ck
from k3post.checkpoint import BrokenCheckpointError, latest_checkpoint, load_trainer_state, save_checkpoint
from k3post.errors import UserError


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class _Payload:
    """Unpickling this runs ``open(marker, "w")`` (what a planted checkpoint would do with os.system)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.marker), "w"))


# --------------------------------------------------------------------------- §5: loads run no code


def test_a_planted_trainer_state_runs_no_code(tmp_path):
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, None, None, {"x": 1})
    ckpt = latest_checkpoint(root)
    assert load_trainer_state(ckpt)["x"] == 1  # tensors and plain data load with weights_only=True
    marker = tmp_path / "pwned"
    torch.save({"x": _Payload(marker)}, ckpt / "trainer_state.pt")
    with pytest.raises(UserError, match="trainer_state.pt: refused: it holds objects other than tensors"):
        load_trainer_state(ckpt)
    assert not marker.exists()


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    import random

    import numpy as np

    root = tmp_path / "ckpt"
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    np.random.normal()  # a cached Gaussian is part of numpy's state
    save_checkpoint(root, 1, None, None, {})
    want = (torch.rand(3), random.random(), np.random.normal(), np.random.rand(3))
    ck.set_rng_state(load_trainer_state(latest_checkpoint(root))["rng"])
    got = (torch.rand(3), random.random(), np.random.normal(), np.random.rand(3))
    assert torch.equal(want[0], got[0]) and want[1] == got[1] and want[2] == got[2] and (want[3] == got[3]).all()


def test_an_older_checkpoints_numpy_rng_state_still_loads(tmp_path):
    """Checkpoints written before issue 30 pickled numpy's RNG state as an ndarray: allowed by name."""
    import numpy as np

    folder = tmp_path / "step-000001"
    folder.mkdir()
    torch.save({"step": 1, "rng": {"torch": torch.get_rng_state(), "python": __import__("random").getstate(),
                                   "numpy": np.random.get_state()}}, folder / "trainer_state.pt")
    state = load_trainer_state(folder)
    ck.set_rng_state(state["rng"])
    assert state["step"] == 1


def _dcp_checkpoint(folder: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=folder)
    return m, opt


def test_dcp_loads_through_the_allow_list_and_a_planted_metadata_runs_no_code(tmp_path):
    import warnings

    folder = tmp_path / "dcp"
    m, opt = _dcp_checkpoint(folder)
    m2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck.load_dcp(m2, opt2, folder)
    assert torch.equal(m2.weight, m.weight) and opt2.param_groups[0]["lr"] == 0.01
    assert torch.equal(opt2.state[m2.weight]["exp_avg"], opt.state[m.weight]["exp_avg"])
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UserError, match=r"\.metadata: refused: not a DCP metadata file \(io.open is not allowed"):
        ck.load_dcp(m2, opt2, folder)
    assert not marker.exists()


def test_dcp_non_tensor_values_load_weights_only(tmp_path):
    """DCP keeps non-tensor values (the optimizer's hyperparameters) as torch.save bytes: a planted one is refused."""
    planner = ck._safe_dcp_planner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    item = type("R", (), {"dest_index": type("I", (), {"fqn": "x"})()})()
    buf = io.BytesIO()
    torch.save(0.5, buf)
    buf.seek(0)
    planner.load_bytes(item, buf)
    assert planner.state_dict["x"] == 0.5
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, buf)
    assert not marker.exists()


# --------------------------------------------------------------------------- §4: incomplete checkpoints


def _three(root: Path) -> None:
    for step in (1, 2, 3):
        save_checkpoint(root, step, None, None, {"x": step}, keep_last=3)


def test_a_checkpoint_lists_its_files_and_sizes(tmp_path):
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, None, None, {"x": 1}, write_extra=lambda f: (f / "extra.bin").write_bytes(b"abc"))
    import json

    files = json.loads((root / "step-000001" / "manifest.json").read_text())["files"]
    assert files["extra.bin"] == 3 and files["trainer_state.pt"] > 0
    assert ck.checkpoint_problem(root / "step-000001") is None
    (root / "step-000001" / "extra.bin").write_bytes(b"a")
    assert ck.checkpoint_problem(root / "step-000001") == "extra.bin has 1 bytes, manifest.json says 3"


@pytest.mark.parametrize("damage", ["trainer_state", "manifest_file", "latest_and_newest"])
def test_an_incomplete_newest_checkpoint_is_an_error_naming_it_and_the_newest_intact(tmp_path, damage):
    """`latest` naming a checkpoint without trainer_state.pt (or with a file the manifest lists missing), or no
    `latest` and an incomplete newest step: BrokenCheckpointError naming both; nothing on disk changes (no
    rotation, no cleanup)."""
    root = tmp_path / "ckpt"
    _three(root)
    if damage == "trainer_state":
        (root / "step-000003" / "trainer_state.pt").unlink()
    elif damage == "manifest_file":
        (root / "step-000003" / "manifest.json").write_text('{"step": 3, "files": {"model.safetensors": 10}}')
    else:
        (root / "latest").unlink()
        (root / "step-000003" / "trainer_state.pt").unlink()
    before = _snapshot(root)
    with pytest.raises(BrokenCheckpointError) as ei:
        latest_checkpoint(root, keep_last=1)
    msg = str(ei.value)
    assert str(root / "step-000003") in msg and f"the newest intact checkpoint is {root / 'step-000002'}" in msg
    assert "run.on_broken_checkpoint=fallback" in msg and "run.restart=true" in msg
    assert _snapshot(root) == before


def test_fall_back_moves_the_broken_ones_aside_and_resumes_from_the_newest_intact(tmp_path):
    root = tmp_path / "ckpt"
    _three(root)
    (root / "step-000003" / "trainer_state.pt").unlink()
    (root / "step-000002" / "trainer_state.pt").unlink()
    assert ck.fall_back(root) == root / "step-000001"
    assert sorted(p.name for p in root.iterdir()) == ["broken-step-000002", "broken-step-000003", "latest", "step-000001"]
    assert latest_checkpoint(root).name == "step-000001"
    (root / "step-000001" / "trainer_state.pt").unlink()
    with pytest.raises(BrokenCheckpointError, match="no intact checkpoint to fall back to"):
        ck.fall_back(root)


def test_a_missing_latest_with_a_complete_newest_checkpoint_resumes_from_it(tmp_path):
    """A kill between the rename of the first checkpoint and the write of `latest` leaves exactly this: the
    newest step folder is complete (its manifest says so), so it is what the folder says."""
    root = tmp_path / "ckpt"
    _three(root)
    (root / "latest").unlink()
    assert latest_checkpoint(root).name == "step-000003"
    (root / "step-000003" / "manifest.json").unlink()  # an older k3post's checkpoint: completeness unknown
    with pytest.raises(BrokenCheckpointError, match="its manifest is missing"):
        latest_checkpoint(root)


# --------------------------------------------------------------------------- §4: the run folder through the CLI

_TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             moe_intermediate_size=32, num_experts=2, num_experts_per_tok=1, intermediate_size=64)


@pytest.fixture
def sft_cfg(tmp_path, xtml_tokenizer) -> Path:
    """A 4-step SFT config (a checkpoint every step, all kept) on a tiny saved model: run folder tmp/r."""
    from k3post.models import build_tiny_moe, save_model
    from test_sft import _records, _write

    tok = xtml_tokenizer
    model_dir = save_model(build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, **_TINY), tmp_path / "m", tok)
    data = _write(tmp_path, _records(4))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: {{root: {tmp_path}, name: r}}\nmodel: {{path: {model_dir}}}\nqat: {{enabled: false}}\n"
                   f"sft: {{train_file: {data}, steps: 4, rows_per_batch: 2, save_every: 1, keep_last: 4, log_every: 1, "
                   "progress: false}\n")
    return cfg


def _sft(cfg: Path, *overrides: str) -> int:
    from k3post.cli import main

    return main(["sft", str(cfg), *overrides])


def _forbid_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """An input check that loads the model first fails the test."""
    import k3post.recipes.commands as commands

    def no_load(*a, **k):
        raise AssertionError("loaded a model before checking the input")

    monkeypatch.setattr(commands, "load_model", no_load)


def _rows(run: Path) -> list[int]:
    from k3post.metrics import read_metrics

    return [r["step"] for r in read_metrics(run / "metrics.jsonl", "sft")]


def test_an_incomplete_newest_checkpoint_stops_sft_and_fallback_resumes_from_the_intact_one(sft_cfg, capsys):
    """Issue 30 §4: the newest checkpoint without trainer_state.pt made `k3post sft` start again from step 0,
    truncate metrics.jsonl and rotate away the good checkpoints. Now: exit 2 naming it and the newest intact
    one, nothing on disk changed; with run.on_broken_checkpoint=fallback it is moved aside, loudly, and the
    run resumes from step 3."""
    run = sft_cfg.parent / "r"
    ckpts = run / "sft" / "checkpoints"
    assert _sft(sft_cfg) == 0 and _rows(run) == [1, 2, 3, 4]
    (ckpts / "step-000004" / "trainer_state.pt").unlink()
    before = _snapshot(run)
    capsys.readouterr()
    assert _sft(sft_cfg) == 2
    err = capsys.readouterr().err
    assert f"{ckpts / 'step-000004'}, which {ckpts / 'latest'} names, is incomplete: trainer_state.pt is missing" in err
    assert f"the newest intact checkpoint is {ckpts / 'step-000003'}" in err
    assert _snapshot(run) == before
    assert _sft(sft_cfg, "run.on_broken_checkpoint=fallback") == 0
    err = capsys.readouterr().err
    assert "k3post: warning:" in err and f"resuming from {ckpts / 'step-000003'}" in err
    assert (ckpts / "broken-step-000004" / "config.json").is_file()
    assert (ckpts / "step-000004" / "trainer_state.pt").is_file() and _rows(run) == [1, 2, 3, 4]


def test_a_missing_latest_pointer_resumes_from_the_newest_complete_checkpoint(sft_cfg, capsys):
    run = sft_cfg.parent / "r"
    assert _sft(sft_cfg) == 0
    (run / "sft" / "checkpoints" / "latest").unlink()
    rows = (run / "metrics.jsonl").read_text()
    assert _sft(sft_cfg) == 0
    assert (run / "metrics.jsonl").read_text() == rows  # resumed at step 4 of 4: nothing trained, nothing dropped
    assert sorted(p.name for p in (run / "sft" / "checkpoints").glob("step-*")) == [f"step-00000{i}" for i in (1, 2, 3, 4)]


_HOLDER = """
import sys, time
sys.path.insert(0, {tests!r})
from k3post.config import load_config
from k3post.runs import open_run
cfg = load_config({cfg!r})
open_run(cfg.run.dir, cfg, "sft")
print("locked", flush=True)
time.sleep(600)
"""


def test_a_second_command_on_a_run_folder_in_use_exits_2_naming_the_holder(sft_cfg, capsys):
    """Issue 30 §4: two processes wrote one run folder at once (every metric row twice). The folder is locked
    while a command writes it; a second command exits 2 naming the holder's pid, and writes nothing."""
    import subprocess
    import sys

    run = sft_cfg.parent / "r"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    code = _HOLDER.format(tests=str(Path(__file__).parent), cfg=str(sft_cfg))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        before = _snapshot(run)
        assert _sft(sft_cfg) == 2
        err = capsys.readouterr().err
        assert f"k3post: error: {run}: the run folder is in use by another k3post command (pid {proc.pid})" in err
        assert _snapshot(run) == before and not (run / "sft").exists()
    finally:
        proc.kill()
        proc.wait()
    assert _sft(sft_cfg) == 0  # the lock went with the process


def test_changed_settings_on_an_existing_run_are_refused_and_restart_moves_the_old_run_aside(sft_cfg, capsys):
    """Issue 30 §4: rerunning a finished SFT with another sft.lr "resumed", trained nothing and rewrote
    config.yaml. Now: exit 2 listing the changed key, nothing written; a free key (progress) may change;
    run.restart=true moves the old run to r.restart-1 (not deleted) and trains afresh."""
    run = sft_cfg.parent / "r"
    assert _sft(sft_cfg) == 0
    before = _snapshot(run)
    capsys.readouterr()
    assert _sft(sft_cfg, "sft.lr=0.001", "sft.steps=6") == 2
    err = capsys.readouterr().err
    assert "sft ran with other settings; changed: sft.lr: 0.005 → 0.001; sft.steps: 4 → 6." in err
    assert "run.restart=true" in err
    assert _snapshot(run) == before
    assert _sft(sft_cfg, "sft.progress=true", "sft.log_every=2") == 0
    assert _sft(sft_cfg, "sft.lr=0.001", "run.restart=true") == 0
    old = run.with_name("r.restart-1")
    kept = ("config.yaml", "k3post.log", "threads.json", "stages.json", ".k3post.lock", "tensorboard/", "summary.json")
    assert {k: v for k, v in _snapshot(old).items() if not k.startswith(kept)} == {
        k: v for k, v in before.items() if not k.startswith(kept)}  # the checkpoints, final/ and the metrics
    assert "lr: 0.001" in (run / "config.yaml").read_text() and _rows(run) == [1, 2, 3, 4]
    assert _sft(sft_cfg, "sft.lr=0.001") == 0  # the new settings are now the run's


@pytest.mark.parametrize("override, message", [
    ("tokenizer.path=/nonexistent", "tokenizer.path: /nonexistent does not exist"),
    ("sft.precision=fp64", "sft.precision must be fp32 or bf16, got 'fp64'"),
    ("sft.betas=[2,3]", "sft.betas must be two numbers in [0, 1), got [2.0, 3.0]"),
    ("model.dtype=fp64", "model.dtype must be one of"),
    ("sft.train_file=/nonexistent.jsonl", "sft.train_file: /nonexistent.jsonl: file not found"),
    ("model.path=/nonexistent", "model.path: /nonexistent is not a model folder"),
])  # fmt: skip
def test_input_errors_exit_2_before_loading_or_writing_anything(sft_cfg, override, message, capsys, monkeypatch):
    """Issue 30 §5: these exited 1 ("not an input error") after loading the model and creating the run folder."""
    _forbid_model_load(monkeypatch)
    before = _snapshot(sft_cfg.parent)
    assert _sft(sft_cfg, override) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3post: error: ") and message in err, err
    assert _snapshot(sft_cfg.parent) == before and not (sft_cfg.parent / "r").exists()


@pytest.mark.parametrize("line, message", [
    ('{"messages": [', ":3: malformed JSON"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', ":3: messages[0]: unknown role 'wizard'"),
])  # fmt: skip
def test_a_bad_line_in_the_train_file_exits_2_before_writing_anything(sft_cfg, line, message, capsys, monkeypatch):
    """A bad JSONL line was found only after the run folder, config.yaml and stages.json were written (the
    lines were checked while rendering, after the model load); the structural checks now run first."""
    data = sft_cfg.parent / "bad.jsonl"
    rows = (sft_cfg.parent / "train.jsonl").read_text().splitlines()  # the fixture's good data
    data.write_text("\n".join([*rows[:2], line]) + "\n")
    _forbid_model_load(monkeypatch)
    before = _snapshot(sft_cfg.parent)
    assert _sft(sft_cfg, f"sft.train_file={data}") == 2
    err = capsys.readouterr().err
    assert f"{data}{message}" in err, err
    assert _snapshot(sft_cfg.parent) == before and not (sft_cfg.parent / "r").exists()


def test_an_input_error_on_an_existing_run_leaves_its_config_yaml(sft_cfg, capsys):
    run = sft_cfg.parent / "r"
    assert _sft(sft_cfg) == 0
    before = _snapshot(run)
    assert _sft(sft_cfg, "sft.train_file=/nonexistent.jsonl") == 2
    assert _snapshot(run) == before


def test_rl_with_a_missing_init_exits_2_and_creates_no_run_folder(tmp_path, capsys):
    from k3post.cli import main

    assert main(["rl", "configs/demo.yaml", f"run.root={tmp_path}", "run.name=r", f"rl.init={tmp_path}/none"]) == 2
    assert f"rl.init: {tmp_path}/none is not a model folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_mopd_inputs_take_an_endpoint_teacher_and_name_a_missing_folder(tmp_path):
    """`mopd.experts.<name>` may be an OpenAI-compatible URL (the README's teacher behind `k3post serve`): the
    input check let only model folders through, so the documented command stopped with "not a model folder"
    (found by tests/test_docs.py). A missing folder is still named."""
    from k3post.config import load_config
    from k3post.errors import UserError
    from k3post.models import build_tiny_moe, save_model
    from k3post.runs import check_inputs

    save_model(build_tiny_moe(64, "tiny", seed=0), tmp_path / "init")
    base = [f"run.root={tmp_path}", f"rl.init={tmp_path / 'init'}"]
    check_inputs(load_config(None, [*base, "mopd.experts.coding.max=http://127.0.0.1:8001/v1"]), "mopd")
    with pytest.raises(UserError, match=f"mopd.experts.coding.max: {tmp_path}/gone is not a model folder"):
        check_inputs(load_config(None, [*base, f"mopd.experts.coding.max={tmp_path}/gone"]), "mopd")


def _rl_run(tmp_path: Path, *overrides: str):  # noqa: ANN202
    from k3post.config import load_config

    init = tmp_path / "init"
    init.mkdir(exist_ok=True)
    (init / "config.json").write_text("{}")
    return load_config(None, [f"run.root={tmp_path}", "run.name=r", f"rl.init={init}", *overrides])


def test_rl_settings_are_per_expert_and_restart_moves_only_that_stage_aside(tmp_path):
    """Each RL expert (rl/<domain>.<effort>) has its own record: another domain is not a change; a changed
    rl.optim.lr for the same expert is refused; run.restart=true moves rl/general.max to rl/general.max.restart-1
    and leaves the rest of the run (sft/, the other expert) where it was."""
    from k3post.runs import open_run, release_runs

    run = tmp_path / "r"
    try:
        open_run(run, _rl_run(tmp_path), "rl")
        (run / "rl" / "general.max").mkdir(parents=True)
        (run / "sft").mkdir()
        open_run(run, _rl_run(tmp_path, "rl.domain=coding", "rl.optim.lr=0.5"), "rl")
        (run / "rl" / "coding.max").mkdir(parents=True)
        with pytest.raises(UserError, match=r"rl/general.max ran with other settings; changed: rl.optim.lr: 0.0001 → 0.5"):
            open_run(run, _rl_run(tmp_path, "rl.optim.lr=0.5"), "rl")
        open_run(run, _rl_run(tmp_path, "rl.optim.lr=0.5", "run.restart=true"), "rl")
        assert sorted(p.name for p in (run / "rl").iterdir()) == ["coding.max", "general.max.restart-1"]
        assert (run / "sft").is_dir()
        open_run(run, _rl_run(tmp_path, "rl.optim.lr=0.5"), "rl")  # now the expert's settings
    finally:
        release_runs()


def test_demo_overwrite_moves_the_finished_run_aside_instead_of_deleting_it(tmp_path):
    from k3post.config import load_config
    from k3post.recipes.demo import _run_dir
    from k3post.runs import open_run, release_runs

    run = tmp_path / "demo"
    run.mkdir()
    (run / "summary.json").write_text('{"status": "done"}')
    cfg = load_config(None, [f"run.root={tmp_path}"])
    assert _run_dir(cfg) == tmp_path / "demo-1"  # a finished run is never written into
    cfg = load_config(None, [f"run.root={tmp_path}", "run.overwrite=true"])
    try:
        assert open_run(_run_dir(cfg), cfg, "demo") == run
    finally:
        release_runs()
    assert (tmp_path / "demo.restart-1" / "summary.json").read_text() == '{"status": "done"}'
    assert not (run / "summary.json").exists()
