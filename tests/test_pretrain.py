"""Stage 0: the generated corpus, the base cache, exact resume, config errors and the copy probe."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import k3post.stages.pretrain as pretrain
from k3post.cli import main
from k3post.config import load_config
from k3post.synth import corpus
from k3post.synth.corpus import (KEYS, document_text, encode_pieces, generate_corpus, held_out_names, is_held_out,
                                 record_pieces)
from k3post.tokenizer import train_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A BPE trained on generated documents (seconds), saved: the runs' tokenizer.path."""
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer([document_text(d) for d in generate_corpus(300, 99, 1200)], vocab_size=512, out_dir=out,
                    word_boundaries=False)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    from k3post.tokenizer import load_tokenizer

    return load_tokenizer(tok_dir)


# ------------------------------------------------------------------------------------------------ corpus


def test_corpus_is_deterministic_by_seed():
    assert generate_corpus(12, 3, 600) == generate_corpus(12, 3, 600)
    assert generate_corpus(12, 3, 600) != generate_corpus(12, 4, 600)


_FACT = re.compile(r"^(Again: the|The) (.+?) of (\S+) is (\S+)\.$", re.M)


def _check_restatements(docs):
    """Every "Again: ..." fact restates one introduced earlier in its document, with the same value; returns
    how many restatements (facts and rosters listed again in order) the documents hold."""
    n_again = 0
    for text in docs:
        seen: dict[tuple[str, str], str] = {}
        for m in _FACT.finditer(text):
            kind, key, owner, value = m.groups()
            if kind == "The":
                seen[(key, owner)] = value
            else:
                assert seen.get((key, owner)) == value, m.group(0)
                n_again += 1
        for what, names in re.findall(r"^(\w+): ((?:[A-Z]\w+, )+[A-Z]\w+)\.$", text, re.M):
            if what in ("Roster", "Guests", "Crew", "Suppliers") and f"{what} again: {names}." in text:
                n_again += 1
    return n_again


def test_restatements_follow_their_introductions(monkeypatch):
    docs = [document_text(d) for d in generate_corpus(60, 0, 2000)]
    assert _check_restatements(docs) >= 2 * len(docs)
    monkeypatch.setattr(corpus, "restate", _fresh_names)  # the planted bug of the learning check is caught here too
    with pytest.raises(AssertionError, match="Again"):
        _check_restatements([document_text(d) for d in generate_corpus(60, 0, 2000)])


_CRC_V1_SEED5 = 3478640280  # measured at 78047a7, before recent_share


def _fact_gaps(docs):
    """Characters between each "Again" fact and its introduction."""
    gaps = []
    for text in docs:
        seen: dict[tuple[str, str], int] = {}
        for m in _FACT.finditer(text):
            kind, key, owner, _ = m.groups()
            if kind == "The":
                seen[(key, owner)] = m.start()
            else:
                gaps.append(m.start() - seen[(key, owner)])
    return gaps


def test_recent_share_shortens_copy_distances_and_zero_keeps_the_corpus():
    """recent_share 0 draws the same documents as before the option existed (no extra random draws); at 0.7 the
    median fact restatement is closer to its introduction, and every restatement is still right."""
    import random
    import zlib

    plain = generate_corpus(40, 5, 3000)
    # the corpus of CORPUS_VERSION 1 as written before recent_share existed: a crc of seed 5's documents
    assert zlib.crc32("".join(document_text(d) for d in plain).encode()) == _CRC_V1_SEED5
    recent = generate_corpus(40, 5, 3000, recent_share=0.7)
    assert _check_restatements([document_text(d) for d in recent]) >= 2 * len(recent)
    far = sorted(_fact_gaps([document_text(d) for d in plain]))
    near = sorted(_fact_gaps([document_text(d) for d in recent]))
    assert near[len(near) // 2] < 0.6 * far[len(far) // 2], (near[len(near) // 2], far[len(far) // 2])
    picks = [corpus._pick_pending(10, random.Random(k), 1.0) for k in range(2000)]
    assert 0.4 < picks.count(9) / len(picks) < 0.6 and min(picks) >= 0  # the newest with probability 1/2


def test_held_out_names_never_appear():
    held = held_out_names()
    assert 0.08 < len(held) / (30 * 30 + 30 ** 3) < 0.17  # one in 8, by hash
    words = set(re.findall(r"[A-Z][a-z]+", "".join(document_text(d) for d in generate_corpus(300, 0, 2000))))
    assert len(words) > 1000
    assert len(words & set(held)) == 0 and all(is_held_out(w) for w in held)


def test_probe_sequences_restate_at_the_distance(tok):
    held = set(held_out_names())
    for d in (20, 100):
        seqs = pretrain.probe_sequences(tok, d, 6, seed=1)
        assert len(seqs) == 6
        for ids, start, n in seqs:
            assert 2 <= n <= 3
            name = ids[start:start + n]
            assert ids[start - d:start - d + n] == name  # the introduction, d tokens earlier
            assert tok.decode(name) in held


# ------------------------------------------------------------------------------------------------ command


def _cfg_file(tmp_path: Path, tok_dir: Path, **extra: str) -> Path:
    body = {"run.root": str(tmp_path / "runs"), "run.name": "pt", "tokenizer.path": str(tok_dir),
            "pretrain.steps": "4", "pretrain.induction_steps": "2", "pretrain.n_docs": "24", "pretrain.seq_len": "96", "pretrain.rows_per_batch": "2",
            "pretrain.save_every": "2", "pretrain.warmup_steps": "1", "pretrain.progress": "false",
            "pretrain.probe_names": "4", "pretrain.probe_distances": "[20]",
            "pretrain.cache_dir": str(tmp_path / "cache"), **extra}
    tree: dict = {}
    for k, v in body.items():
        sec, key = k.split(".")
        tree.setdefault(sec, {})[key] = v
    path = tmp_path / "pt.yaml"
    path.write_text("".join(f"{s}:\n" + "".join(f"  {k}: {v}\n" for k, v in kv.items()) for s, kv in tree.items()))
    return path


def test_pretrain_caches_the_base_by_content_hash(tmp_path, tok_dir, monkeypatch, capsys):
    cfg_path = _cfg_file(tmp_path, tok_dir)
    assert main(["pretrain", str(cfg_path)]) == 0
    out = capsys.readouterr().out
    cfg = load_config(cfg_path)
    base = tmp_path / "cache" / "bases" / pretrain.base_key(cfg)
    assert f"pretrained base (cached, key {pretrain.base_key(cfg)}): {base}" in out
    assert "20 tokens back" in out
    assert (base / "config.json").is_file() and (base / "tokenizer.json").is_file() and (base / "probe.json").is_file()
    assert not [p for p in base.parent.iterdir() if p.name.startswith(".tmp")]

    def no_training(*a, **k):
        raise AssertionError("a cache hit trains nothing")

    monkeypatch.setattr(pretrain, "train_sft", no_training)
    assert main(["pretrain", str(cfg_path), "pretrain.log_every=1", "pretrain.probe_names=3"]) == 0  # same key
    assert f"(cached, key {pretrain.base_key(cfg)})" in capsys.readouterr().out
    # a setting the weights depend on is another key: a miss, which trains
    other = load_config(cfg_path, ["pretrain.lr=1e-3"])
    assert pretrain.base_key(other) != pretrain.base_key(cfg)
    assert pretrain.base_key(load_config(cfg_path, ["run.seed=1"])) != pretrain.base_key(cfg)
    with pytest.raises(AssertionError, match="trains nothing"):
        pretrain.run_pretrain(load_config(cfg_path, ["pretrain.lr=1e-3", "run.name=pt2"]))


def test_publish_base_is_atomic(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_text("w")
    dest = tmp_path / "bases" / "k"
    real_copy = shutil.copy2

    def torn(s, d, *a, **k):  # the copy dies after the first file
        if Path(s).name == "model.safetensors":
            raise OSError("disk full")
        return real_copy(s, d, *a, **k)

    monkeypatch.setattr(shutil, "copy2", torn)
    with pytest.raises(Exception, match="disk full"):
        pretrain.publish_base(src, dest)
    assert not dest.exists() and not list(dest.parent.iterdir())  # a reader never sees half a base
    monkeypatch.setattr(shutil, "copy2", real_copy)
    assert pretrain.publish_base(src, dest) == dest and (dest / "model.safetensors").read_text() == "w"
    (src / "model.safetensors").write_text("other")  # a second builder of the same key keeps the first base
    assert pretrain.publish_base(src, dest) == dest and (dest / "model.safetensors").read_text() == "w"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["k"]


def test_pretrain_resume_is_exact(tmp_path, tok_dir, monkeypatch):
    """Killed right after the checkpoint of step 2 (of 4), the rerun resumes there and ends with the
    uninterrupted run's weights and per-step losses, bit for bit."""
    import k3post.checkpoint as ck
    from k3post.metrics import read_metrics
    from k3post.runs import release_runs
    from safetensors.torch import load_file

    cfg_path = _cfg_file(tmp_path, tok_dir, **{"pretrain.cache": "false", "pretrain.log_every": "1"})
    full_cfg, cut_cfg = load_config(cfg_path), load_config(cfg_path, ["run.name=cut"])
    full = load_file(pretrain.run_pretrain(full_cfg) / "model.safetensors")
    release_runs()
    real = ck.save_checkpoint

    class Killed(Exception):
        pass

    def save_then_die(root, step, *a, **kw):
        path = real(root, step, *a, **kw)
        if step == 2:
            raise Killed
        return path

    monkeypatch.setattr(ck, "save_checkpoint", save_then_die)
    with pytest.raises(Killed):
        pretrain.run_pretrain(cut_cfg)
    release_runs()
    monkeypatch.setattr(ck, "save_checkpoint", real)
    again = load_file(pretrain.run_pretrain(cut_cfg) / "model.safetensors")
    assert full.keys() == again.keys()
    assert all(torch.equal(full[k], again[k]) for k in full)

    def losses(cfg):
        return [r["step_loss"] for r in read_metrics(cfg.run.dir / "metrics.jsonl") if r["stage"] == "pretrain"]

    assert len(losses(full_cfg)) == 4 and losses(cut_cfg) == losses(full_cfg)
    from k3post.recipes.report import write_report

    page = write_report(cut_cfg.run.dir).read_text()
    assert "Stage 0: pretrained base" in page and "Copy probe" in page


@pytest.mark.parametrize("override", ["pretrain.steps=0", "pretrain.seq_len=4", "pretrain.probe_distances=[8]",
                                      "pretrain.recall_share=1.5", "pretrain.keep_last=0", "pretrain.stepz=3"])
def test_bad_pretrain_config_exits_2_before_writing(tmp_path, tok_dir, override, capsys):
    cfg_path = _cfg_file(tmp_path, tok_dir)
    assert main(["pretrain", str(cfg_path), override]) == 2
    assert override.split("=")[0] in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


def test_pretrain_refuses_model_path(tmp_path, tok_dir, capsys):
    assert main(["pretrain", str(_cfg_file(tmp_path, tok_dir)), f"model.path={tmp_path}"]) == 2
    assert "model.path" in capsys.readouterr().err


def test_readme_commands(tmp_path, tok_dir, capsys, monkeypatch):
    """The README's `k3post pretrain configs/demo.yaml` (made small) and `python bench/copy_probe.py <base>`."""
    import importlib.util

    monkeypatch.setenv("K3POST_CACHE", str(tmp_path / "cache"))
    small = [f"run.root={tmp_path / 'runs'}", f"tokenizer.path={tok_dir}", "pretrain.steps=2", "pretrain.induction_steps=2",
             "pretrain.n_docs=8", "pretrain.seq_len=64", "pretrain.rows_per_batch=2", "pretrain.progress=false", "pretrain.probe_names=2"]
    assert main(["pretrain", "configs/demo.yaml", *small]) == 0
    base = Path(capsys.readouterr().out.strip().splitlines()[-1].split(": ", 1)[1])
    assert base.parent == tmp_path / "cache" / "bases" and (base / "config.json").is_file()
    spec = importlib.util.spec_from_file_location("copy_probe", Path(__file__).resolve().parents[1] / "bench" / "copy_probe.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main([str(base), "--n", "2", "--distances", "20,100,300"])
    assert set(out["probe"]) == {"20", "100", "300"} and all(r["n"] == 2 for r in out["probe"].values())


# ------------------------------------------------------------------------------------------------ learning

# docs/decisions.md, issue 31 §copy: on the corpus alone copying did not appear by 6,000 steps in most runs; with phase 1
# (induction rows until they are copied, at most 4,000 steps) two corpus phases of 2,400 steps copied 0.98-1.0 at 20 back
LEARN_STEPS, LEARN_LR, LEARN_MIN, LEARN_BUG_MAX = 2400, 3e-3, 0.3, 0.1
_LEARN = dict(steps=LEARN_STEPS, n_docs=2000, seq_len=128, rows_per_batch=8, lr=LEARN_LR, warmup_steps=20, progress=False)


def _fresh_names(pieces, rng, draw):
    """The planted bug: a restatement draws fresh names instead of restating the ones introduced."""
    return [draw(rng) if corpus._NAME.fullmatch(p) else p for p in pieces]


def _copy_after_pretrain(tok, tmp_path, seed):
    from k3post.config.pretrain import PretrainConfig
    from k3post.models import build_tiny_moe

    p = PretrainConfig(**_LEARN)
    samples = pretrain.corpus_samples(tok, pretrain.corpus_documents(p, seed), p.seq_len)
    model = build_tiny_moe(len(tok), "tiny", seed=seed, pad_token_id=tok.pad_token_id)
    before = pretrain.copy_probe(model, tok, [20], n=48, seed=seed)["20"]["token_acc"]
    pretrain.train_base(model, tok, samples, p, tmp_path / f"s{seed}", seed=seed)
    return before, pretrain.copy_probe(model, tok, [20], n=48, seed=seed)["20"]["token_acc"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_pretraining_teaches_copying(tok, tmp_path, seed):
    """A short pretrain makes the held-out names restated 20 tokens back far more predictable than the untrained
    model does (copying: the names were never in the corpus)."""
    before, after = _copy_after_pretrain(tok, tmp_path, seed)
    assert before < 0.1 and after > LEARN_MIN, (before, after)


@pytest.mark.slow
def test_copying_needs_the_restatements(tok, tmp_path, monkeypatch):
    """The planted bug (restatements draw fresh names) leaves the probe near chance: the check above would fail."""
    monkeypatch.setattr(corpus, "restate", _fresh_names)
    before, after = _copy_after_pretrain(tok, tmp_path, 0)
    assert after < LEARN_BUG_MAX, (before, after)


# ------------------------------------------------------------------------------------- induction rows, warning


def test_induction_rows_repeat_a_span_of_ordinary_tokens(tok):
    rows = pretrain.induction_samples(tok, 40, 96, seed=3)
    special = set(tok.all_special_ids)
    nl = encode_pieces(tok, ["\n"])
    assert len(rows) == 40 and all(len(r.ids) == 96 and all(r.loss_mask) for r in rows)
    periods = set()
    for r in rows:
        period = r.ids.index(nl[-1]) + 1  # the span, then the newline: the row repeats with that period
        assert 8 + len(nl) <= period <= 30 + len(nl)
        assert all(r.ids[i] == r.ids[i + period] for i in range(96 - period))
        assert not special & set(r.ids[:period - len(nl)])
        periods.add(period)
    assert len(periods) > 5  # spans of many lengths
    assert [r.ids for r in pretrain.induction_samples(tok, 40, 96, seed=3)] == [r.ids for r in rows]
    assert [r.ids for r in pretrain.induction_samples(tok, 40, 96, seed=4)] != [r.ids for r in rows]


def test_induction_steps_run_first_and_enter_the_key_only_when_on(tmp_path, tok_dir):
    from k3post.metrics import read_metrics

    cfg = load_config(_cfg_file(tmp_path, tok_dir))
    off = load_config(_cfg_file(tmp_path, tok_dir), ["pretrain.induction_steps=0"])
    assert "induction_steps" not in pretrain.base_key_fields(off)["pretrain"]  # keys of bases built without it stay
    assert pretrain.base_key(off) != pretrain.base_key(cfg)
    base = pretrain.run_pretrain(cfg)
    rows = read_metrics(cfg.run.dir / "metrics.jsonl")
    stages = [r["stage"] for r in rows if r["stage"].startswith("pretrain")]
    assert stages.index("pretrain/induction") < stages.index("pretrain")  # phase 1, then the corpus
    assert (cfg.run.dir / "pretrain" / "induction" / "checkpoints").is_dir()
    assert json.loads((base / "train.json").read_text())["induction_steps"] == 2


def test_copy_warning_says_when_a_base_does_not_copy():
    probe = {"100": {"exact": 0.9, "token_acc": 0.95, "n": 48}, "20": {"exact": 0.125, "token_acc": 0.4, "n": 48}}
    msg = pretrain.copy_warning(probe)
    assert msg is not None and "does not copy" in msg and "0.125" in msg and "20 tokens back" in msg and "n 48" in msg
    probe["20"]["exact"] = pretrain.COPY_OK
    assert pretrain.copy_warning(probe) is None  # the shortest distance decides
    assert pretrain.copy_warning({}) is None


class _InductionOracle(torch.nn.Module):
    """Predicts the token that followed the last earlier occurrence of the current token (a perfect induction head)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids, **kw):
        B, L = input_ids.shape
        logits = torch.zeros(B, L, self.vocab)
        for b in range(B):
            row = input_ids[b].tolist()
            for t in range(L):
                prev = [j for j in range(t) if row[j] == row[t]]
                logits[b, t, row[prev[-1] + 1] if prev else 0] = 1.0
        return type("Out", (), {"logits": logits})()


def test_induction_accuracy_separates_a_copier_from_an_untrained_model(tok):
    from k3post.models import build_tiny_moe

    # where a token occurs once in its span, the oracle is right by construction; a token drawn twice may mislead it
    rows = pretrain._induction_rows(tok, 8, 96, "k3post-induction-probe|0")
    sure = sum(sum(ids[:period].count(ids[t]) == 1 for t in range(period, min(2 * period, 96) - 1)) for ids, period in rows)
    total = sum(min(2 * period, 96) - 1 - period for _, period in rows)
    assert sure / total > 0.8
    assert pretrain.induction_accuracy(_InductionOracle(len(tok)), tok, 96, seed=0, n=8) >= sure / total
    untrained = build_tiny_moe(len(tok), "tiny", seed=0, pad_token_id=tok.pad_token_id)
    assert pretrain.induction_accuracy(untrained, tok, 96, seed=0, n=8) < 0.05


def test_phase_one_stops_when_its_target_is_reached_at_a_constant_lr(tmp_path, tok_dir, monkeypatch):
    from k3post.metrics import read_metrics

    seen = []

    def fake_accuracy(model, tokenizer, seq_len, seed, n=64):
        seen.append(1)
        return 0.95 if len(seen) == 2 else 0.1  # reached at the second check

    monkeypatch.setattr(pretrain, "induction_accuracy", fake_accuracy)
    cfg = load_config(_cfg_file(tmp_path, tok_dir, **{"pretrain.induction_steps": "8", "pretrain.induction_check_every": "2",
                                                      "pretrain.cache": "false", "pretrain.log_every": "1"}))
    base = pretrain.run_pretrain(cfg)
    formed = json.loads((base / "train.json").read_text())["induction"]
    assert formed == {"steps": 4, "induction_acc": 0.95, "target": 0.9, "reached": True}
    rows = read_metrics(cfg.run.dir / "metrics.jsonl")
    assert [r["step"] for r in rows if r["stage"] == "pretrain/induction"] == [1, 2, 3, 4]  # stopped at 4 of 8
    assert [r["step"] for r in rows if r["stage"] == "pretrain/induction_probe"] == [2, 4]
    lrs = [r["lr"] for r in rows if r["stage"] == "pretrain/induction"]
    assert lrs[1:] == [cfg.pretrain.lr] * 3  # constant after the one warmup step: where it stops changes nothing before


def test_phase_one_that_never_reaches_its_target_runs_its_cap_and_says_so(tmp_path, tok_dir, monkeypatch, capsys):
    monkeypatch.setattr(pretrain, "induction_accuracy", lambda *a, **k: 0.2)
    cfg = load_config(_cfg_file(tmp_path, tok_dir, **{"pretrain.induction_steps": "6", "pretrain.induction_check_every": "4",
                                                      "pretrain.cache": "false"}))
    base = pretrain.run_pretrain(cfg)
    assert json.loads((base / "train.json").read_text())["induction"] == {"steps": 6, "induction_acc": 0.2, "target": 0.9,
                                                                         "reached": False}


def test_a_rerun_of_phase_one_resumes_where_it_stopped_not_at_its_first_check(tmp_path, tok, monkeypatch):
    """Phase 1 stopped at its second check (step 4 of 8); a rerun over the same folder (a kill in the corpus phase)
    must reload step 4 and keep the record: not measure the final weights at check 1 and stop there."""
    from k3post.config.pretrain import PretrainConfig

    table = {}  # weights fingerprint -> the accuracy the first run gave them

    def fingerprint(model):
        return round(float(sum(p.detach().double().sum() for p in model.parameters())), 6)

    def first_run(model, tokenizer, seq_len, seed, n=64):
        acc = 0.95 if table else 0.1  # reached at the second check
        table[fingerprint(model)] = acc
        return acc

    def rerun(model, tokenizer, seq_len, seed, n=64):
        return table[fingerprint(model)]

    p = PretrainConfig(steps=2, induction_steps=8, induction_check_every=2, n_docs=8, seq_len=64, rows_per_batch=2,
                       warmup_steps=1, save_every=2, progress=False)
    samples = pretrain.corpus_samples(tok, pretrain.corpus_documents(p, 0), p.seq_len)

    def run(acc):
        from k3post.models import build_tiny_moe

        monkeypatch.setattr(pretrain, "induction_accuracy", acc)
        model = build_tiny_moe(len(tok), "tiny", seed=0, pad_token_id=tok.pad_token_id)
        pretrain.train_base(model, tok, samples, p, tmp_path, seed=0)
        return json.loads((tmp_path / "induction" / "formed.json").read_text())

    assert run(first_run)["steps"] == 4
    assert run(rerun) == {"steps": 4, "induction_acc": 0.95, "target": 0.9, "reached": True}


def test_sft_samples_replay_induction_rows(tmp_path, tok):
    """sft.replay_induction: N induction rows of pretrain.seq_len tokens join the file's SFT samples, every token a
    target, drawn with a seed of their own (not stage 0's rows), the same on every call; 0 adds none."""
    from k3post.stages.sft_data import REPLAY_SEED_OFFSET, sft_samples

    rec = {"messages": [{"role": "user", "content": "Name the badge."}, {"role": "assistant", "content": "Vorwen."}], "effort": None}
    f = tmp_path / "sft.jsonl"
    f.write_text(json.dumps(rec) + "\n")
    cfg = load_config(None, ["sft.replay_induction=3", "pretrain.seq_len=32", "run.seed=5"])
    samples, stats = sft_samples(cfg, f, tok)
    assert stats.kept == 1 and len(samples) == 4
    rows = samples[1:]
    assert all(len(r) == 32 and all(r.loss_mask) and r.source.startswith("induction:") for r in rows)
    assert [r.ids for r in rows] == [r.ids for r in pretrain.induction_samples(tok, 3, 32, 5 + REPLAY_SEED_OFFSET)]
    assert [r.ids for r in rows] != [r.ids for r in pretrain.induction_samples(tok, 3, 32, 5)]  # not stage 0's own rows
    assert [r.ids for r in sft_samples(cfg, f, tok)[0][1:]] == [r.ids for r in rows]
    assert len(sft_samples(load_config(None, ["pretrain.seq_len=32"]), f, tok)[0]) == 1
