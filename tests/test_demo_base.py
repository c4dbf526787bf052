"""`k3post demo` from the pretrained base (stage 0, `demo.base`): built once into the cache, reused after,
its tokenizer and weights the run's start; `cached` without a base says so; resume inside and after stage 0.
Everything shrunk (3 pretraining steps on 8 short documents, 2 SFT steps, no RL / MOPD / drafts)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from k3post.stages import pretrain
from k3post.cli import main
from k3post.config import load_config
from k3post.recipes.demo import domains_to_show, run_demo
from k3post.metrics import read_metrics
from k3post.runs import release_runs


def _tiny(tmp_path, name, *extra):
    return [
        f"run.root={tmp_path / 'runs'}", f"run.name={name}", "demo.base=build", "data.n_train=12", "data.n_per_family=0",
        "data.family_tasks.coding.write_function=0", "data.family_tasks.agents.search=0", "data.n_eval=3", "data.efforts=[max]", "data.effort_mix={}",
        "data.corpus_per_family=1", "tokenizer.vocab_size=400",
        "sft.steps=2", "sft.log_every=1", "sft.save_every=1", "sft.rows_per_batch=1", "sft.max_len=4096", "sft.progress=false", "demo.mtp_weight=0",
        "eval.max_new_tokens=8", "eval.efforts=[max]", "rl.steps=0", "mopd.rl.steps=0", "demo.drafts=[]",
        "demo.compare_no_qat=false",
        "pretrain.steps=3", "pretrain.induction_steps=2", "pretrain.n_docs=8", "pretrain.seq_len=64", "pretrain.rows_per_batch=2",
        "pretrain.save_every=1", "pretrain.log_every=1", "pretrain.warmup_steps=1", "pretrain.progress=false",
        "pretrain.probe_names=2", "pretrain.probe_distances=[60]", f"pretrain.cache_dir={tmp_path / 'cache'}",
        *extra,
    ]


def _rows(run, stage):
    return [r["step"] for r in read_metrics(run / "metrics.jsonl", stage)] if (run / "metrics.jsonl").is_file() else []


def _weights(folder):
    return load_file(folder / "model.safetensors")


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_demo_builds_the_base_once_resumes_it_and_starts_from_it(tmp_path, monkeypatch, capsys):
    """Run a: killed after stage 0's checkpoint of step 2 (of 3), the demo resumes stage 0 there (each
    pretraining step logged once, ``resumed_from`` 2) and publishes the base under its key; killed in SFT, it
    resumes with that base, building none. The run's tokenizer and initial weights are the base's. Run b, same
    settings: nothing trained (the builder is never called, no ``pretrain`` rows); with ``sft.lr=0`` and no
    QAT its SFT model is the base, weight for weight, so SFT started from it."""
    import k3post.checkpoint as ck
    from k3post.tokenizer import load_tokenizer

    cfg = load_config(None, _tiny(tmp_path, "a"))
    key = pretrain.base_key(cfg)
    base = tmp_path / "cache" / "bases" / key
    run = cfg.run.dir
    real = ck.save_checkpoint

    class Killed(Exception):
        pass

    def kill_at(stage, at):
        def save_then_die(root, step, *a, **kw):
            path = real(root, step, *a, **kw)
            if Path(root).parent.name == stage and step == at:
                raise Killed
            return path
        return save_then_die

    monkeypatch.setattr(ck, "save_checkpoint", kill_at("pretrain", 2))
    with pytest.raises(Killed):
        run_demo(cfg)
    release_runs()
    assert _rows(run, "pretrain") == [1, 2] and not base.exists()
    assert f"stage 0: building the pretrained base (key {key}" in capsys.readouterr().out
    monkeypatch.setattr(ck, "save_checkpoint", kill_at("sft", 1))
    with pytest.raises(Killed):
        run_demo(cfg)
    release_runs()
    assert json.loads((base / "train.json").read_text())["resumed_from"] == 2
    assert _rows(run, "pretrain") == [1, 2, 3] and _rows(run, "pretrain/probe") == [3]
    assert _rows(run, "pretrain/induction") == [1, 2]  # phase 1 once: the resume reloaded it and went on
    assert [p.name for p in base.parent.iterdir()] == [key]
    monkeypatch.setattr(ck, "save_checkpoint", real)

    def no_build(*a, **k):
        raise AssertionError("the base is built: nothing to train")

    monkeypatch.setattr("k3post.recipes.demo.build_base", no_build)
    assert run_demo(cfg) == run
    release_runs()
    s = json.loads((run / "summary.json").read_text())
    pre = s["pretrain"]
    assert s["status"] == "done" and _rows(run, "pretrain") == [1, 2, 3]
    assert pre["used"] and pre["built"] and pre["key"] == key and pre["path"] == str(base) and pre["steps"] == 3
    assert pre["corpus_tokens"] > 0 and set(pre["probe"]) == {"60"} and pre["build_s"] is not None
    assert "pretrain" in s["timings"] and s["post_training_wall_s"] <= s["wall_s"]
    # the base's tokenizer (BPE on the demo's corpus + generated documents) is the run's
    run_tok, base_tok = load_tokenizer(run / "tokenizer"), load_tokenizer(base)
    assert run_tok.get_vocab() == base_tok.get_vocab()
    text = "The badge of Kelmor is Vorwen. <|end_of_msg|>"
    assert run_tok.encode(text, add_special_tokens=False) == base_tok.encode(text, add_special_tokens=False)
    assert _same(_weights(run / "model_init"), _weights(base))
    page = (run / "report.html").read_text()
    assert "Stage 0: pretrained base" in page and key in page and "built in this run" in page and "Copy probe" in page
    # the same probe on the SFT model, at the base's distances, beside the base's in the report
    assert set(s["sft_copy"]) == {"60"} and 0 <= s["sft_copy"]["60"]["exact"] <= 1 and "after SFT: exact" in page
    # three steps teach no copying: the run, its log and its report say so
    assert "does not copy" in pre["warning"] and "does not copy" in page
    assert pre["induction"]["steps"] == 2 and "held-out induction accuracy" in page  # phase 1 stopped at its cap
    assert "WARNING: stage 0: this base does not copy" in capsys.readouterr().out

    assert main(["demo", *_tiny(tmp_path, "b", "sft.lr=0", "qat.enabled=false")]) == 0
    run_b = tmp_path / "runs" / "b"
    pre_b = json.loads((run_b / "summary.json").read_text())["pretrain"]
    assert pre_b["used"] and not pre_b["built"] and pre_b["build_s"] is None and pre_b["key"] == key
    assert pre_b["probe"] == pre["probe"]  # read back from the base's probe.json
    assert _rows(run_b, "pretrain") == [] and _rows(run_b, "sft") == [1, 2]
    assert f"stage 0: pretrained base {key} (cached)" in capsys.readouterr().out
    assert _same(_weights(run_b / "sft" / "final"), _weights(base))  # lr 0: SFT's start, unchanged
    assert "cached (built by an earlier run" in (run_b / "report.html").read_text()


def test_cached_without_a_base_runs_without_one_and_says_so(tmp_path, capsys):
    assert main(["demo", *_tiny(tmp_path, "c", "demo.base=cached")]) == 0
    run = tmp_path / "runs" / "c"
    pre = json.loads((run / "summary.json").read_text())["pretrain"]
    assert not pre["used"] and pre["mode"] == "cached" and "no base with key" in pre["reason"]
    assert "no pretrained base: demo.base=cached" in capsys.readouterr().out
    assert "no pretrained base: demo.base=cached" in (run / "k3post.log").read_text()
    assert "This run has no pretrained base" in (run / "report.html").read_text()
    assert _rows(run, "pretrain") == [] and not (tmp_path / "cache" / "bases").exists()
    assert (run / "model_init" / "config.json").is_file()


def test_a_base_of_another_shape_is_a_clear_error(tmp_path, capsys):
    """A folder under the run's key whose shapes are not ``model.preset``'s: exit 2 naming it, before SFT."""
    from k3post.models import build_tiny_moe, save_model

    cfg = load_config(None, _tiny(tmp_path, "m"))
    wrong = tmp_path / "cache" / "bases" / pretrain.base_key(cfg)
    save_model(build_tiny_moe(400, "small"), wrong)
    assert main(["demo", *_tiny(tmp_path, "m")]) == 2
    err = capsys.readouterr().err
    assert "does not match the run's model" in err and "hidden_size 256 (model.preset=tiny: 128)" in err
    assert not (cfg.run.dir / "sft").exists()


def test_base_keys_follow_the_recipes_tokenizer_settings():
    """configs/full.yaml's BPE (2,048 tokens, the families' lexicon) reaches the base's key, so the demo and
    the full recipe get different bases; the base's BPE takes the lexicon as the run's would."""
    demo, full = load_config("configs/demo.yaml"), load_config("configs/full.yaml")
    assert (demo.demo.base, full.demo.base) == ("cached", "build")  # the demo keeps its 15-minute budget
    assert pretrain.base_key(demo) != pretrain.base_key(full)
    assert pretrain.base_key_fields(full)["tokenizer"]["lexicon_repeats"] == 200
    assert pretrain.base_key(load_config("configs/full.yaml", ["tokenizer.lexicon_repeats=100"])) != pretrain.base_key(full)
    # not every demo key: a post-training setting leaves the base as it is
    assert pretrain.base_key(load_config("configs/demo.yaml", ["sft.lr=1e-3", "demo.base=cached"])) == pretrain.base_key(demo)


def test_base_tokenizer_takes_the_family_lexicon(tmp_path):
    """configs/full.yaml's `tokenizer.lexicon_repeats` reaches stage 0's BPE: a knowledge-graph name of lexicon
    syllables is a few tokens (without the lexicon it is more than 5: test_demo's lexicon test)."""
    cfg = load_config(None, ["tokenizer.lexicon_repeats=200", "tokenizer.vocab_size=2048", "data.corpus_per_family=1"])
    tok = pretrain._tokenizer(cfg, [], tmp_path / "tok")
    assert len(tok.encode(" Quordel Zeltov", add_special_tokens=False)) <= 5


def test_bad_demo_base_is_a_clear_error(tmp_path, capsys):
    assert main(["demo", f"run.root={tmp_path}", "demo.base=maybe"]) == 2
    assert "demo.base must be one of ['build', 'cached', 'none']" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def _expert(p, n=100, verdict="no significant change"):
    return {"sft_pass_rate": p, "n": n, "pass_rate": p, "change": {"verdict": verdict}}


def test_domains_to_show_follow_the_sft_pass_rate():
    rows = domains_to_show({"general.max": _expert(0.45, 400, "higher"), "general.low": _expert(0.1),
                            "agents.max": _expert(0.0), "coding.max": _expert(0.82, 50)}, {"general": 8, "agents": 8})
    by = {r["domain"]: r for r in rows}
    assert set(by) == {"general", "agents", "coding"}  # one line per domain, from its max expert
    assert by["general"]["inside"] and by["general"]["verdict"] == "RL > SFT shown (greedy, paired p < 0.05); SFT passes 45%"
    assert by["general"]["n"] == 400 and by["general"]["rl_verdict"] == "higher"
    lo, hi = by["general"]["sft_ci95"]
    assert lo < 0.45 < hi and hi - lo < 0.11  # Wilson at n 400
    assert by["general"]["mixed_groups"] == pytest.approx(1 - 0.45 ** 8 - 0.55 ** 8)
    assert not by["agents"]["inside"] and by["agents"]["verdict"].startswith("too hard") and by["agents"]["mixed_groups"] == 0
    assert not by["coding"]["inside"] and by["coding"]["verdict"].startswith("too easy") and by["coding"]["mixed_groups"] is None
    assert by["coding"]["room"] == pytest.approx(0.18)
    assert by["general"]["rl_sampled"] is None  # no rl.eval_samples: greedy only


def test_domains_to_show_carry_the_sampled_verdict_and_the_report_prints_it(tmp_path):
    from k3post.recipes.report import _domains_section

    e = {**_expert(0.3, 400), "sampled": {"k": 8, "sft": 0.2, "rl": 0.23, "change": {"delta": 0.03, "p_value": 0.004,
                                                                                          "verdict": "higher"}}}
    (row,) = domains_to_show({"general.max": e}, {"general": 8})
    assert row["rl_sampled"] == {"k": 8, "sft": 0.2, "rl": 0.23, "delta": 0.03, "p_value": 0.004, "verdict": "higher"}
    html = _domains_section(tmp_path, {"domains": [row]})
    assert "greedy 0.300 → 0.300 (no significant change); avg@8 0.200 → 0.230 (Δ +0.030, p 0.004: higher)" in html
    # a gain the paired test resolves is what the run shows, also outside the window (the demo's seed 0: greedy 0.175)
    low = {**e, "sft_pass_rate": 0.175, "change": {"verdict": "higher"}}
    (row,) = domains_to_show({"general.max": low}, {"general": 8})
    assert row["verdict"] == "RL > SFT shown (greedy and avg@8, paired p < 0.05); SFT passes 18%, outside 20%–70%"
    quiet = {**e, "sft_pass_rate": 0.175, "sampled": {**e["sampled"], "change": {**e["sampled"]["change"], "verdict": "no significant change"}}}
    assert domains_to_show({"general.max": quiet}, {"general": 8})[0]["verdict"].startswith("too hard")


def test_domains_to_show_state_the_measured_share_of_groups_with_a_signal(tmp_path):
    """The expected share (from the greedy SFT pass) is a model; an expert that recorded how many of its training
    groups held a pass and a fail (`experts._mixed_share`) has the measured share in its row, verdict and report."""
    from k3post.recipes.experts import _mixed_share
    from k3post.loop import StageLog
    from k3post.recipes.report import _domains_section

    import json

    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps({"stage": "rl/general.max", "step": s, "time": 0.0, "groups": g, "zero_variance_groups": z}) + "\n"
                         for s, g, z in [(1, 32, 8), (2, 32, 16), (3, 0, 0)]))
    assert _mixed_share(StageLog(f, "rl/general.max", 3)) == pytest.approx(1 - 24 / 64)
    assert _mixed_share(StageLog(f, "rl/general.high", 3)) is None  # no rows: no groups
    e = {**_expert(0.1, 300), "mixed_groups": 0.625}
    (row,) = domains_to_show({"general.max": e}, {"general": 8})
    assert row["mixed_groups"] == pytest.approx(1 - 0.1 ** 8 - 0.9 ** 8) and row["mixed_measured"] == 0.625
    assert row["verdict"] == "too hard: SFT passes 10% < 20%; 62% of RL's training groups held a pass and a fail"
    html = _domains_section(tmp_path, {"domains": [row]})
    assert "measured in RL&#x27;s training groups" in html or "measured in RL's training groups" in html
    assert "<td>0.62</td>" in html or ">0.62<" in html
