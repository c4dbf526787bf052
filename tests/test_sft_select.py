"""``sft.select: validation`` (`k3post.recipes.select`): the SFT model is the kept checkpoint that passes most validation
tasks; the choice is recorded, installed as sft/final with the last model kept in sft/last, kept on resume, reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3post.cli import main
from k3post.config import load_config
from k3post.errors import UserError
from k3post.recipes import select as select_mod
from k3post.recipes.report import write_report
from tests.test_sft import _records, _write

CKPTS = ["step-000004", "step-000008", "step-000012"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("select")
    assert main(["init-model", str(tmp / "m"), "--vocab-size", "320"]) == 0
    data = _write(tmp, _records(40))
    cfg = tmp / "c.yaml"
    cfg.write_text(f"run:\n  root: {tmp}\n  name: r\nmodel:\n  path: {tmp / 'm'}\n"
                   "sft:\n  steps: 12\n  rows_per_batch: 2\n  save_every: 4\n  keep_last: 3\n  progress: false\n"
                   "  select: validation\n  select_domains: [general]\n  select_n: 6\n"
                   "rl:\n  domain_overrides:\n    general: {eval_max_tokens: 8}\n")
    assert main(["sft", str(cfg), f"sft.train_file={data}", "sft.lr=2e-3"]) == 0
    return tmp / "r", cfg


def _weights(folder: Path) -> bytes:
    return (folder / "model.safetensors").read_bytes()


def test_every_kept_checkpoint_is_scored_and_the_best_is_the_sft_model(run):
    r, _ = run
    sel = json.loads((r / "sft" / "selection.json").read_text())
    assert [row["checkpoint"] for row in sel["rows"]] == CKPTS and sel["last"] == CKPTS[-1]
    for row in sel["rows"]:
        assert list(row["domains"]) == ["general"] and row["domains"]["general"]["n"] == 6
        assert row["mean_pass"] == row["domains"]["general"]["pass"]
    means = [row["mean_pass"] for row in sel["rows"]]
    assert sel["chosen"] == CKPTS[max(range(3), key=lambda i: (means[i], i))]  # ties go to the later checkpoint
    assert _weights(r / "sft" / "final") == _weights(r / "sft" / "checkpoints" / sel["chosen"])
    assert (r / "sft" / "last").is_dir() == (sel["chosen"] != CKPTS[-1])
    assert json.loads((r / "summary.json").read_text())["sft_selection"]["chosen"] == sel["chosen"]
    html = write_report(r).read_text()
    assert "highest mean validation pass" in html and sel["chosen"] in html


def test_a_better_earlier_checkpoint_replaces_final_and_the_last_moves_aside(run, monkeypatch):
    """The install path, with the scores fixed so that the first checkpoint wins: sft/final becomes it (model, MTP
    and tokenizer files; not the trainer state), the last model moves to sft/last; a resumed stage that saved its last
    model to final again gets the choice back without scoring again."""
    r, cfg_path = run
    sft = r / "sft"
    cfg = load_config(cfg_path, [])
    (sft / "selection.json").unlink()
    last_weights = _weights(sft / "checkpoints" / CKPTS[-1])
    if (sft / "last").is_dir():  # the real scores chose an earlier one: put the last model back as the stage leaves it
        import shutil
        shutil.rmtree(sft / "final")
        (sft / "last").rename(sft / "final")
    assert _weights(sft / "final") == last_weights

    def scored(path, cfg, effort, domains, *, split, n):
        assert split == "validation" and n == 6 and effort == "max"
        return {d: {"pass_rate": 0.5 if Path(path).name == CKPTS[0] else 0.25, "n": n, "pass_ci95": (0.1, 0.9)}
                for d in domains}

    monkeypatch.setattr(select_mod, "domain_pass", scored)
    sel = select_mod.select_checkpoint(cfg, sft)
    assert sel["chosen"] == CKPTS[0] and [row["mean_pass"] for row in sel["rows"]] == [0.5, 0.25, 0.25]
    assert _weights(sft / "final") == _weights(sft / "checkpoints" / CKPTS[0]) != last_weights
    assert _weights(sft / "last") == last_weights
    assert not (sft / "final" / "trainer_state.pt").exists() and (sft / "final" / "tokenizer.json").is_file()

    # resumed: the stage saved its last model into final again; the recorded choice is installed, nothing scored
    (sft / "final" / "model.safetensors").write_bytes(last_weights)
    monkeypatch.setattr(select_mod, "domain_pass", lambda *a, **k: pytest.fail("scored again on resume"))
    assert select_mod.select_checkpoint(cfg, sft)["chosen"] == CKPTS[0]
    assert _weights(sft / "final") == _weights(sft / "checkpoints" / CKPTS[0])
    assert _weights(sft / "last") == last_weights


@pytest.mark.parametrize("override, match", [
    ("sft.select=best", "sft.select must be last or validation"),
    ("sft.select_domains=[general,chess]", "sft.select_domains"),
    ("sft.select_effort=medium", "sft.select_effort"),
])
def test_bad_selection_settings_are_named(override, match):
    with pytest.raises(Exception, match=match):
        load_config(None, [override])


def test_validation_needs_checkpoints_to_choose_from():
    with pytest.raises(Exception, match="keep at least 2"):
        load_config(None, ["sft.select=validation", "sft.keep_last=1"])
    assert load_config(None, []).sft.select == "last"  # off by default: the demo's SFT model is its last step


def test_checkpoints_are_scored_in_process_whatever_engine_the_run_uses(run):
    """A run whose RL engines are remote servers (serving the policy it trains) still scores each checkpoint on its
    own weights: the scorer builds an embedded engine (no server listens at the URL below)."""
    r, cfg_path = run
    cfg = load_config(cfg_path, ["rl.rollout.engine.kind=http", "rl.rollout.engine.urls=[http://127.0.0.1:9]"])
    got = select_mod.domain_pass(r / "sft" / "checkpoints" / CKPTS[0], cfg, "max", ["general"], split="validation", n=2)
    assert got["general"]["n"] == 2 and not got["general"]["infra"]


def test_no_checkpoint_left_to_choose_from_is_named(tmp_path):
    cfg = load_config(None, ["sft.select=validation", "sft.keep_last=3"])
    (tmp_path / "sft" / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserError, match="no complete checkpoint under .*checkpoints"):
        select_mod.select_checkpoint(cfg, tmp_path / "sft")
