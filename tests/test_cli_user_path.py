"""Issue 34: the user-model path through the `k3post` command line (findings the issue lists, one test each)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from user_models import save_user_model

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "numpy", "fastapi", "ray")


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)


def test_help_imports_no_torch_or_transformers():
    """`k3post --help` and each sub-command's --help build the parser without the ML stack (was 6.4 s: transformers)."""
    code = (
        "import sys, contextlib, io\n"
        "from k3post.cli import main\n"
        "for argv in (['--help'], ['sft', '--help'], ['serve', '--help'], ['tasks', 'list', '--help'], ['synth', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as e:\n"
        "            assert e.code == 0, (argv, e.code)\n"
        "    assert 'usage: k3post' in out.getvalue(), argv\n"
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"--help imported {r.stdout.strip()}"


_TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             moe_intermediate_size=32, num_experts=2, num_experts_per_tok=1, intermediate_size=64)


@pytest.fixture()
def tiny_model_dir(xtml_tokenizer, tmp_path) -> Path:
    """A saved tiny Qwen3-MoE with the XTML tokenizer, as `k3post init-model` writes it (smaller)."""
    from k3post.models import build_tiny_moe, save_model
    from k3post.xtml import XTML

    tok = xtml_tokenizer
    model = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=XTML(tok).eom_id, **_TINY)
    return save_model(model, tmp_path / "model", tok)


@pytest.mark.usefixtures("one_torch_thread")
def test_sft_and_rl_run_folders_report(tiny_model_dir, tmp_path, capsys, caplog):
    """`k3post sft` then `k3post rl` into one run folder: summary.json says status, model and each stage's
    results, and `k3post report` on the folder shows them with the curves from metrics.jsonl (was "status:
    unknown; model ?" and no curves)."""
    from k3post.cli import main
    from test_sft import _records, _write

    data = _write(tmp_path, _records(6))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: {{root: {tmp_path}, name: r}}\nmodel: {{path: {tiny_model_dir}}}\nqat: {{enabled: false}}\n"
                   f"sft: {{train_file: {data}, steps: 2, rows_per_batch: 2, log_every: 1, progress: false}}\n")
    assert main(["sft", str(cfg)]) == 0
    run = tmp_path / "r"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "done" and summary["command"] == "sft"
    assert summary["model"].startswith(f"qwen3_moe from {tiny_model_dir}")
    assert summary["sft"]["steps"] == 2 and summary["sft"]["n_samples"] == 6
    rl = ["rl.steps=2", "rl.n_tasks=2", "rl.rollout.n_prompts=2", "rl.rollout.k=2", "rl.eval_n=2", "rl.rollout.max_tokens=12",
          "rl.eval_max_tokens=8", "rl.families=[general.arithmetic]", "rl.progress=true",
          "rl.effort_control.b0_samples=1",
          # the recipe's general.max setting (GENERAL_MAX_SETTING) sizes the domain itself: shrunk too
          "rl.domain_overrides.general.n_tasks=2", "rl.domain_overrides.general.eval_n=2", "rl.domain_overrides.general.max.rollout.n_prompts=2",
          "rl.domain_overrides.general.max.eval_samples=0"]
    capsys.readouterr()
    with caplog.at_level("INFO"):
        assert main(["rl", str(cfg), *rl]) == 0  # rl.init: the run's sft/final
    # the phases before and after the training bar say what they do and count what remains (were silent)
    err = capsys.readouterr().err
    assert re.search(r"b0 budgets: 100%\|[^|]*\| 2/2 ", err) and re.search(r"held-out eval: 100%\|[^|]*\| 2/2 ", err), err
    assert "b0 budgets: 2 tasks x 1 samples of the cold-start model at max effort" in caplog.text
    assert "held-out evaluation: 2 tasks of general.arithmetic at max effort" in caplog.text
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "done" and summary["command"] == "rl" and "sft" in summary
    assert summary["model"].startswith(f"qwen3_moe from {run / 'sft' / 'final'}")
    entry = summary["rl"]["general.max"]
    assert entry["steps"] == 2 and entry["eval"]["n"] == 2
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "status: done" in page and "model qwen3_moe from" in page
    assert 'alt="SFT loss curve"' in page and 'alt="RL reward curves"' in page and 'alt="RL effort_tokens curves"' in page
    assert "<td>general.max</td><td>2</td>" in page
    capsys.readouterr()
    assert main(["status", str(run)]) == 0  # the one-screen status of the same folder
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"run {run}: done (k3post rl), ") and lines[1].startswith("model: qwen3_moe from ")
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[3:] if ln and not ln.startswith(" ")}
    assert rows["sft"][:4] == ["2", "/", "2", "done"] and rows["sft"][4:6] == ["loss", rows["sft"][5]]
    assert rows["rl/general.max"][:4] == ["2", "/", "2", "done"] and "reward" in rows["rl/general.max"]
    assert "  rl/general.max/checkpoints  step-000002" in lines and "  sft/checkpoints             step-000002" in lines
    assert f"<pre>run {run}: done (k3post rl)" in page  # the report's header shows the same screen


def test_failed_stage_says_so_in_its_summary(tiny_model_dir, tmp_path, capsys):
    """A stage command that fails after its run folder opened leaves status "failed" and the error in
    summary.json (the report's header shows it)."""
    from k3post.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')  # no assistant turn: nothing to train
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: {{root: {tmp_path}, name: r}}\nmodel: {{path: {tiny_model_dir}}}\nqat: {{enabled: false}}\n"
                   f"sft: {{train_file: {bad}, steps: 1, progress: false}}\n")
    assert main(["sft", str(cfg)]) == 2
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and str(bad) in summary["error"]
    assert main(["report", str(tmp_path / "r")]) == 0
    assert "status: failed" in (tmp_path / "r" / "report.html").read_text()
    capsys.readouterr()
    assert main(["status", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"run {tmp_path / 'r'}: failed (k3post sft)") and out[2].startswith("error: DataError: ")
    assert main(["status", str(tmp_path)]) == 2  # not a run folder: one line naming it


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "chat"}, "sft.mode must be think or instruct, got 'chat'"),
    ({"on_bad_sample": "ignore"}, "sft.on_bad_sample must be error or skip, got 'ignore'"),
])  # fmt: skip
def test_a_bad_sft_setting_names_its_key_not_a_data_line(xtml_tokenizer, tmp_path, kwargs, message):
    """`load_sft_jsonl(mode="chat")` was blamed on the data file's first line ("data/sft.jsonl:1: mode must be
    one of ..."); on_bad_sample's error lacked the `sft.` prefix. Both are the setting's error, before any line."""
    from k3post.data import load_sft_jsonl
    from k3post.errors import UserError
    from k3post.xtml import XTML
    from test_sft import _records, _write

    data = _write(tmp_path, _records(2))
    with pytest.raises(UserError) as ei:
        load_sft_jsonl(data, XTML(xtml_tokenizer), max_len=4096, **kwargs)
    assert str(ei.value) == message


_TORCH_FULL_DISK = ("[enforce fail at inline_container.cc:672] . unexpected pos 512 vs 398")  # torch.save's zip writer


@pytest.mark.parametrize("error", [
    lambda: OSError(28, "No space left on device"),
    lambda: RuntimeError(_TORCH_FULL_DISK),
    lambda: RuntimeError("PytorchStreamWriter failed writing file data/3: file write failed"),
])  # fmt: skip
def test_full_disk_while_checkpointing_says_no_space_left_and_keeps_what_was_written(tmp_path, monkeypatch, error):
    """torch.save on a full disk raises a RuntimeError ("enforce fail at inline_container.cc:672 ... unexpected
    pos"), which reached the user as is. Now: a CheckpointWriteError "no space left on <folder>", the partial
    folder removed, the checkpoint written before intact and named, `latest` still naming it."""
    import torch

    from k3post import checkpoint as ck

    root = tmp_path / "checkpoints"
    first = ck.save_checkpoint(root, 1, None, None, {"x": torch.ones(2)})
    real = torch.save

    def full(obj, f, *a, **k):
        real(obj, f, *a, **k)  # part of the file reaches the disk, then the write stops
        raise error()

    monkeypatch.setattr(ck.torch, "save", full)
    with pytest.raises(ck.CheckpointWriteError) as ei:
        ck.save_checkpoint(root, 2, None, None, {"x": torch.ones(2)})
    msg = str(ei.value)
    assert ei.value.errno == 28
    assert f"cannot write checkpoint step-000002 into {root}: the disk is full: no space left on {root}" in msg
    assert f"the last complete checkpoint, {first}, is intact" in msg
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
    monkeypatch.undo()
    assert ck.latest_checkpoint(root) == first and ck.load_trainer_state(first)["x"].tolist() == [1.0, 1.0]


def test_another_save_failure_is_not_called_a_full_disk(tmp_path, monkeypatch):
    """Only a write that ran out of space says so: any other error of torch.save comes out unchanged."""
    import torch

    from k3post import checkpoint as ck

    def bad(obj, f, *a, **k):
        raise RuntimeError("Can't pickle local object")

    monkeypatch.setattr(ck.torch, "save", bad)
    with pytest.raises(RuntimeError, match="^Can't pickle local object$"):
        ck.save_checkpoint(tmp_path / "c", 1, None, None, {"x": torch.ones(2)})
    assert not any((tmp_path / "c").glob(".tmp-step-*"))


def test_a_damaged_newest_checkpoint_names_the_older_one_to_resume_from(tiny_model_dir, tmp_path, capsys):
    """The newest checkpoint's weights file damaged in place (its size unchanged, so the manifest holds): the
    error named only the damaged checkpoint. Now: exit 2 naming the older complete one and how to resume from
    it; following that resumes from it."""
    from k3post.cli import main
    from test_sft import _records, _write

    data = _write(tmp_path, _records(4))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: {{root: {tmp_path}, name: r}}\nmodel: {{path: {tiny_model_dir}}}\nqat: {{enabled: false}}\n"
                   f"sft: {{train_file: {data}, steps: 4, rows_per_batch: 2, save_every: 2, progress: false}}\n")
    assert main(["sft", str(cfg)]) == 0
    ckpts = tmp_path / "r" / "sft" / "checkpoints"
    newest, older = ckpts / "step-000004", ckpts / "step-000002"
    weights = newest / "model.safetensors"
    with weights.open("r+b") as fh:  # the header's length field: garbage, same file size
        fh.write(b"\xff" * 8)
    capsys.readouterr()
    assert main(["sft", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{newest} cannot be loaded" in err and f"the newest older complete checkpoint is {older}" in err
    assert "run.on_broken_checkpoint=fallback" in err
    newest.rename(ckpts / "broken-step-000004")  # what the message says to do
    assert main(["sft", str(cfg), "run.on_broken_checkpoint=fallback"]) == 0
    assert (ckpts / "latest").read_text().strip() == "step-000004"  # resumed from step 2, wrote step 4 again


@pytest.fixture(scope="module")
def user_llama(tmp_path_factory) -> Path:
    """A tiny Llama saved with a tokenizer of the user's own: a byte-level BPE with `<s>` / `</s>` and none of
    the XTML tokens (as a newcomer's model folder is)."""
    return save_user_model("llama", tmp_path_factory.mktemp("user") / "tiny-llama")


def test_serve_and_synth_on_a_user_tokenizer_say_how_to_add_the_xtml_tokens(user_llama, tmp_path, capsys):
    """`k3post serve` / `k3post synth --tokenizer` on a folder whose tokenizer lacks the XTML tokens exited 1
    telling a CLI user to call a Python function. Now exit 2 naming `k3post add-tokens`; that command writes a
    copy that serves and synthesizes, with the embeddings resized to the new vocabulary."""
    from k3post.cli import main
    from k3post.models import load_model
    from k3post.serve.cli import build_server
    from k3post.tokenizer import SPECIAL_TOKENS, load_tokenizer

    assert main(["serve", str(user_llama)]) == 2
    err = capsys.readouterr().err  # the thread policy's line comes first (k3post.threads), then the error
    assert f"\nk3post: error: {user_llama}: the tokenizer lacks the XTML tokens" in "\n" + err and \
        f"`k3post add-tokens {user_llama} OUT_DIR`" in err
    synth = ["synth", "--family", "general.arithmetic", "--effort", "max", "--n", "2", "--out", str(tmp_path / "d.jsonl")]
    assert main([*synth, "--tokenizer", str(user_llama)]) == 2
    assert "k3post add-tokens" in capsys.readouterr().err and not (tmp_path / "d.jsonl").exists()

    out = tmp_path / "tiny-llama-xtml"
    assert main(["add-tokens", str(user_llama), str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {out}: added ") and all(t in printed for t in SPECIAL_TOKENS)
    tok = load_tokenizer(out, require_xtml=True)
    assert len(tok) == len(load_tokenizer(user_llama)) + len(SPECIAL_TOKENS) + 1  # + <|pad|>: it had no pad
    assert load_model(out).get_input_embeddings().weight.shape[0] == len(tok)
    assert load_model(out).config.model_type == "llama"
    build_server(out, max_batch_size=1, torch_threads=1)  # loads: tokenizer and engine accept it
    assert main([*synth, "--tokenizer", str(out)]) == 0
    assert (tmp_path / "d.jsonl").is_file()
    capsys.readouterr()
    assert main(["add-tokens", str(out), str(tmp_path / "again")]) == 0  # nothing missing: nothing written
    assert "already has the XTML tokens" in capsys.readouterr().out and not (tmp_path / "again").exists()
    assert main(["add-tokens", str(user_llama), str(out)]) == 2  # never over a folder that holds something
    assert "already exists and is not empty" in capsys.readouterr().err


def test_mxfp4_export_of_a_dense_model_is_an_error_that_leaves_no_folder(user_llama, tmp_path, capsys):
    """The doc's `k3post export ... out/my-model-mxfp4` on a dense model failed (exit 1) and left an empty
    folder. Now exit 2 saying to use --format bf16, before any folder is made; bf16 exports it."""
    from k3post.cli import main
    from k3post.models import load_model

    out = tmp_path / "out" / "my-model-mxfp4"
    assert main(["export", str(user_llama), str(out)]) == 2
    err = capsys.readouterr().err
    assert "cannot export as MXFP4" in err and "--format bf16" in err
    assert not (tmp_path / "out").exists()  # not even its parent
    assert main(["export", str(user_llama), str(tmp_path / "bf16"), "--format", "bf16"]) == 0
    assert load_model(tmp_path / "bf16").config.model_type == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16"]  # no temporary folder left


def test_skipped_over_length_samples_are_summarised(tiny_model_dir, xtml_tokenizer, tmp_path, capsys):
    """With sft.on_bad_sample=skip, 110 of 240 samples were dropped with only `{"too_long": 110}`. Now one line:
    how many of how many, the longest against sft.max_len, and the setting that keeps them all; with `error`
    the first one's message names the key and both ways out."""
    from k3post.cli import main
    from k3post.data import load_sft_jsonl
    from k3post.xtml import XTML
    from test_sft import _records, _write

    recs = _records(6)
    lengths = [len(XTML(xtml_tokenizer).render(r["messages"], effort=r["effort"]).ids) for r in recs]
    max_len = sorted(lengths)[2]  # the three longest are over it (ties aside: counted below)
    over = [n for n in lengths if n > max_len]
    data = _write(tmp_path, recs)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: {{root: {tmp_path}, name: r}}\nmodel: {{path: {tiny_model_dir}}}\nqat: {{enabled: false}}\n"
                   f"sft: {{train_file: {data}, steps: 1, rows_per_batch: 2, max_len: {max_len}, progress: false}}\n")
    assert main(["sft", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"longer than max_len={max_len} (sft.max_len: raise it, or sft.on_bad_sample=skip" in err
    assert main(["sft", str(cfg), "sft.on_bad_sample=skip", "run.name=r2"]) == 0
    out = capsys.readouterr().out
    assert (f"skipped {len(over)} of 6 samples: {len(over)} longer than sft.max_len={max_len} tokens (the longest "
            f"{max(over):,}; sft.max_len={max(over)} keeps them all)") in out
    _, stats = load_sft_jsonl(data, XTML(xtml_tokenizer), max_len=max(over), on_bad_sample="skip")
    assert stats.kept == 6 and not stats.skipped  # the setting it names does keep them all
