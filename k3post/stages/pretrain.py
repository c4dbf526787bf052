"""Stage 0: the pretrained base. Causal-LM pretraining of the tiny Qwen3-MoE on the generated corpus
(`k3post.synth.corpus`), cached by content hash, and the copy probe that says whether the base can read.

    k3post pretrain CONFIG [key=value ...]

1. The cache key (`base_key`) hashes what the base depends on: the `pretrain` settings that change the
   weights (not logging, checkpoint cadence, cache place or probe), the model preset and its shapes, the
   tokenizer settings with `REFERENCE_VERSION` (the families' references its corpus is made of), or the sha256
   of ``tokenizer.path``'s tokenizer.json, ``run.seed`` and `CORPUS_VERSION`. A base already in ``<cache>/bases/<key>/`` is returned without training.
2. Otherwise: the tokenizer (``tokenizer.path``, else a byte-level BPE trained on the families' XTML text,
   as `k3post.stages.sft_data.run_tokenizer` trains it, plus the generated documents), the corpus (``pretrain.n_docs``
   documents, each cut at ``pretrain.seq_len`` tokens, every token a target), and the training loop of SFT
   (`k3post.stages.sft.train_sft`: packed rows with no attention across documents, AdamW with warmup + cosine,
   checkpoints in ``<run>/pretrain/checkpoints``, exact resume, progress bar, metrics rows of stage
   ``pretrain``).
3. The final model goes to ``<run>/pretrain/final`` and, written in a temporary folder and renamed into
   place (atomic: a reader sees a whole base or none), to the cache; `copy_probe` runs on it and its result
   is printed, logged (stage ``pretrain/probe``) and kept in the base's ``probe.json``.

Later stages start from the base with ``model.path=<base>`` (its tokenizer is in the same folder).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from k3post.checkpoint import checkpoint_step, latest_checkpoint
from k3post.config import K3Config
from k3post.config.model import ModelConfig
from k3post.config.pretrain import PretrainConfig
from k3post.config.sft import SFTConfig
from k3post.data import Sample
from k3post.envs.families.common import REFERENCE_VERSION
from k3post.errors import UserError
from k3post.stages.sft import train_sft
from k3post.stages.sft_data import tokenizer_texts
from k3post.synth.corpus import (CORPUS_VERSION, KEYS, _induction_rows, document_text, draw_name, encode_pieces,
                                 generate_corpus, generate_document, held_out_names, induction_samples, record_pieces)

__all__ = ["base_key", "cache_root", "cached_base", "base_record", "build_base", "corpus_samples", "copy_probe",
           "run_pretrain", "BASE_FREE_KEYS", "copy_warning", "induction_accuracy", "induction_samples", "induction_settings", "train_base"]

log = logging.getLogger("k3post.pretrain")

BASE_FREE_KEYS = ("save_every", "keep_last", "log_every", "progress", "cache", "cache_dir", "probe_names",
                  "probe_distances")
"""`pretrain` fields that do not change the base's weights (left out of `base_key`)."""


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def base_key_fields(cfg: K3Config) -> dict[str, Any]:
    """What the base's weights depend on (module doc), as JSON."""
    from k3post.models import PRESETS

    p = {k: v for k, v in asdict(cfg.pretrain).items() if k not in BASE_FREE_KEYS}
    if not p["induction_steps"]:  # hashed only when on, so the keys of bases built without it stay the same
        for k in ("induction_steps", "induction_target", "induction_check_every"):
            del p[k]
    if cfg.tokenizer.path:
        tok: dict[str, Any] = {"tokenizer.json": _sha256_file(Path(cfg.tokenizer.path).expanduser() / "tokenizer.json")}
    else:
        tok = {**asdict(cfg.tokenizer), "corpus_per_family": cfg.data.corpus_per_family, "eval_family": cfg.data.eval_family,
               "references": REFERENCE_VERSION}  # the tokenizer is trained on the families' reference trajectories
    return {"corpus_version": CORPUS_VERSION, "pretrain": p, "tokenizer": tok, "seed": cfg.run.seed,
            "model": {"preset": cfg.model.preset, "shape": PRESETS.get(cfg.model.preset), "dtype": cfg.model.dtype,
                      # only when changed, so the keys of bases built before it was hashed stay the same
                      **({"max_position_embeddings": cfg.model.max_position_embeddings}
                         if cfg.model.max_position_embeddings != ModelConfig().max_position_embeddings else {})}}


def base_key(cfg: K3Config) -> str:
    """The base's content hash (24 hex digits of a sha256 of `base_key_fields`)."""
    blob = json.dumps(base_key_fields(cfg), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cache_root(cfg: K3Config) -> Path:
    """``pretrain.cache_dir``, else ``$K3POST_CACHE``, else ``~/.cache/k3post``."""
    root = cfg.pretrain.cache_dir or os.environ.get("K3POST_CACHE") or "~/.cache/k3post"
    return Path(root).expanduser()


def corpus_documents(p: PretrainConfig, seed: int) -> list[list[str]]:
    """The run's documents (``n_chars`` ~ 4 characters per token, so a document fills its ``seq_len``)."""
    return generate_corpus(p.n_docs, seed, 4 * p.seq_len, recall_share=p.recall_share, recent_share=p.recent_share)


def corpus_samples(tokenizer: Any, docs: Sequence[Sequence[str]], seq_len: int) -> list[Sample]:
    """Each document's tokens (`encode_pieces`) cut at ``seq_len``, every one a target."""
    out = []
    for i, d in enumerate(docs):
        ids = encode_pieces(tokenizer, d)[:seq_len]
        out.append(Sample(ids=ids, loss_mask=[True] * len(ids), source=f"corpus:{i}"))
    return out


@torch.no_grad()
def induction_accuracy(model: torch.nn.Module, tokenizer: Any, seq_len: int, seed: int, n: int = 64) -> float:
    """Share of the first repeat's tokens (after its first) that ``model`` predicts by argmax, teacher-forced, on
    ``n`` held-out induction rows (another random stream than the training rows): whether the induction circuit
    has formed (~0 before, ~1 after)."""
    was_training = model.training
    model.eval()
    try:
        rows = _induction_rows(tokenizer, n, seq_len, f"k3post-induction-probe|{seed}")
        ids = torch.tensor([r for r, _ in rows])
        pred = model(input_ids=ids, use_cache=False).logits.argmax(-1)
        right = total = 0
        for b, (_, period) in enumerate(rows):
            end = min(2 * period, seq_len)  # the first repeat: positions period .. 2·period − 1
            right += int((pred[b, period:end - 1] == ids[b, period + 1:end]).sum())
            total += end - 1 - period
        return right / max(total, 1)
    finally:
        model.train(was_training)


def _tokenizer(cfg: K3Config, docs: Sequence[Sequence[str]], out: Path) -> Any:
    from k3post.tokenizer import load_tokenizer, train_tokenizer

    if cfg.tokenizer.path:
        return load_tokenizer(Path(cfg.tokenizer.path).expanduser())
    if (out / "tokenizer.json").is_file():  # a resumed run: the same tokenizer
        return load_tokenizer(out)
    texts = tokenizer_texts(cfg) + [document_text(d) for d in docs[:2000]]
    return train_tokenizer(texts, vocab_size=cfg.tokenizer.vocab_size, out_dir=out,
                           word_boundaries=cfg.tokenizer.word_boundaries)


def induction_settings(p: PretrainConfig) -> SFTConfig:
    """The trainer settings of phase 1 (``p.induction_steps`` steps on induction rows): the corpus phase's, with
    its own warmup and cosine over its own steps."""
    return replace(sft_settings(p), steps=p.induction_steps)


def sft_settings(p: PretrainConfig) -> SFTConfig:
    """The SFT trainer settings that run stage 0's loop."""
    return SFTConfig(max_len=p.seq_len, pack_len=p.seq_len, rows_per_batch=p.rows_per_batch, grad_accum=1,
                     steps=p.steps, lr=p.lr, min_lr_ratio=p.min_lr_ratio, warmup_steps=p.warmup_steps,
                     weight_decay=p.weight_decay, grad_clip=p.grad_clip, save_every=p.save_every,
                     keep_last=p.keep_last, log_every=p.log_every, progress=p.progress)


# --------------------------------------------------------------------------------------------- the probe


def probe_names(tokenizer: Any, n: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """``n`` held-out names (`k3post.synth.corpus.held_out_names`) that are 2–3 tokens, each with its ids; a seeded choice. Fewer when the tokenizer has fewer such names."""
    names = held_out_names()
    random.Random(f"probe|{seed}").shuffle(names)
    out = []
    for name in names:
        ids = encode_pieces(tokenizer, [name])
        if 2 <= len(ids) <= 3:
            out.append((name, ids))
            if len(out) == n:
                break
    return out


def probe_sequences(tokenizer: Any, distance: int, n: int, seed: int = 0) -> list[tuple[list[int], int, int]]:
    """Copy-probe inputs: (ids, start, length) of a held-out name restated ``distance`` tokens after its
    first token was introduced ("The <key> of <Owner> is <Name>." ... filler from the generator ...
    "Again: the <key> of <Owner> is <Name>."): the name's restatement is ids[start:start + length]."""
    rng = random.Random(f"probe|{seed}|{distance}")
    out = []
    for name, name_ids in probe_names(tokenizer, n, seed):
        key, owner = rng.choice(KEYS), draw_name(rng)
        intro = record_pieces(key, owner, name)
        again = record_pieces(key, owner, name, again=True)
        head = encode_pieces(tokenizer, intro[:3])
        tail = encode_pieces(tokenizer, intro[4:])
        cue = encode_pieces(tokenizer, again[:3])
        need = distance - len(name_ids) - len(tail) - len(cue)
        if need < 0:
            raise ValueError(f"copy probe: distance {distance} is shorter than one restatement")
        filler: list[int] = []
        while len(filler) < need:  # the generator's own text, without this owner
            doc = generate_document(rng, 4 * need + 64)
            if owner not in document_text(doc):
                filler += encode_pieces(tokenizer, doc)
        ids = head + name_ids + tail + filler[:need] + cue
        start = len(ids)
        out.append((ids + name_ids + encode_pieces(tokenizer, again[4:]), start, len(name_ids)))
    return out


@torch.no_grad()
def copy_probe(model: torch.nn.Module, tokenizer: Any, distances: Sequence[int] = (20, 100, 300), n: int = 48,
               seed: int = 0, batch: int = 16) -> dict[str, Any]:
    """Teacher-forced copy accuracy of held-out 2–3-token names restated ``distance`` tokens back
    (`probe_sequences`): per distance, ``token_acc`` (name tokens whose argmax is right) and ``exact``
    (names with every token right, the headline "copy accuracy"), and ``n`` names."""
    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id or 0
    res: dict[str, Any] = {}
    try:
        for d in distances:
            seqs = probe_sequences(tokenizer, d, n, seed)
            right_tok = total_tok = exact = 0
            for k in range(0, len(seqs), batch):
                chunk = seqs[k:k + batch]
                L = max(len(s[0]) for s in chunk)
                ids = torch.full((len(chunk), L), pad, dtype=torch.long)
                for r, (s, _, _) in enumerate(chunk):
                    ids[r, :len(s)] = torch.tensor(s)
                pred = model(input_ids=ids, use_cache=False).logits.argmax(-1)  # right padding: causal, harmless
                for r, (s, start, length) in enumerate(chunk):
                    ok = pred[r, start - 1:start - 1 + length] == ids[r, start:start + length]
                    right_tok += int(ok.sum())
                    total_tok += length
                    exact += bool(ok.all())
            res[str(d)] = {"exact": exact / max(len(seqs), 1), "token_acc": right_tok / max(total_tok, 1), "n": len(seqs)}
    finally:
        model.train(was_training)
    return res


def format_probe(probe: dict[str, Any]) -> str:
    return "copy probe (held-out names, teacher-forced): " + "; ".join(
        f"{d} tokens back: {r['exact']:.3f} exact, {r['token_acc']:.3f} of tokens (n {r['n']})" for d, r in probe.items())


# --------------------------------------------------------------------------------------------- the command


#: Exact copy accuracy at the probe's shortest distance below which a base is said not to copy (`copy_warning`).
COPY_OK = 0.5


def copy_warning(probe: dict[str, Any]) -> str | None:
    """A one-line warning when the base cannot copy: exact copy accuracy below `COPY_OK` at the probe's shortest
    distance (None when it copies, or when there is no probe). A base that cannot attend back and copy a name
    teaches later stages nothing that random weights would not (docs/decisions.md, issue 31 §copy), so every
    place that builds or uses one says so."""
    if not probe:
        return None
    d = min(probe, key=int)
    exact = probe[d]["exact"]
    if exact >= COPY_OK:
        return None
    return (f"this base does not copy: {exact:.3f} of held-out names copied exactly from {d} tokens back "
            f"(n {probe[d]['n']}; a copying base scores >= {COPY_OK}); what starts from it starts about where random "
            "weights do (docs/decisions.md, issue 31 §copy)")


def _probe_of(base: Path, cfg: K3Config) -> dict[str, Any]:
    """The base's probe at the configured settings: ``probe.json`` when it matches, else measured now."""
    from k3post.models import load_model
    from k3post.tokenizer import load_tokenizer

    p = cfg.pretrain
    want = {"distances": list(p.probe_distances), "n": p.probe_names, "seed": cfg.run.seed}
    path = base / "probe.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("settings") == want:
            return saved["result"]
    return copy_probe(load_model(base), load_tokenizer(base), p.probe_distances, p.probe_names, cfg.run.seed)


def publish_base(src: Path, dest: Path) -> Path:
    """Copy the model folder ``src`` to ``dest`` atomically (a temporary sibling renamed into place); when
    ``dest`` appeared meanwhile (another process built the same base), keep that one."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(src, tmp, copy_function=shutil.copy2)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, dest)
    except OSError:
        if not (dest / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def cached_base(cfg: K3Config) -> Path | None:
    """The cached base of ``cfg``'s key (`base_key`), when ``pretrain.cache`` is on and it is there."""
    path = cache_root(cfg) / "bases" / base_key(cfg)
    return path if cfg.pretrain.cache and (path / "config.json").is_file() else None


def base_record(base: Path, cfg: K3Config) -> dict[str, Any]:
    """What a report says about ``base``: its key, folder, steps, corpus tokens, phase 1's outcome (``train.json``; a
    base written before it existed gives its configured steps and no token count) and copy probe (`_probe_of`)."""
    train_path = base / "train.json"
    train = json.loads(train_path.read_text()) if train_path.is_file() else {}
    key_path = base / "base_key.json"
    key = json.loads(key_path.read_text()) if key_path.is_file() else {}
    steps = train.get("steps", key.get("fields", {}).get("pretrain", {}).get("steps"))
    return {"key": key.get("key", base_key(cfg)), "path": str(base), "steps": steps,
            "corpus_tokens": train.get("corpus_tokens"), "tokens_per_step": train.get("tokens_per_step"),
            "final_loss": train.get("final_loss"), "induction": train.get("induction"), "probe": _probe_of(base, cfg)}


def _induction_until_formed(model: torch.nn.Module, tokenizer: Any, rows: Sequence[Sample], p: PretrainConfig,
                            out: Path, seed: int, metrics: Any) -> None:
    """Phase 1 with a stopping rule: at a constant learning rate (after warmup), in chunks of
    ``p.induction_check_every`` steps, each ending with a checkpoint and `induction_accuracy`; stop once it reaches
    ``p.induction_target`` or after ``p.induction_steps``. The schedule does not depend on where it stops, so the
    chunks are one run cut at its checkpoints (a rerun walks them again from disk, training nothing it has done)."""
    every = p.induction_check_every
    base = replace(induction_settings(p), min_lr_ratio=1.0, save_every=every)

    def check(end: int) -> float:
        """Train (or, resumed, reload) up to step ``end``, then measure and log the induction accuracy there."""
        train_sft(model, tokenizer, rows, replace(base, steps=end), out, seed=seed, metrics=metrics,
                  stage="pretrain/induction")
        acc = induction_accuracy(model, tokenizer, p.seq_len, seed)
        if metrics is not None:
            metrics.truncate("pretrain/induction_probe", end - 1)
            metrics.log("pretrain/induction_probe", end, {"induction_acc": acc})
        log.info("pretrain: induction accuracy %.3f after %d steps (target %.2f)", acc, end, p.induction_target)
        return acc

    # a rerun starts at phase 1's newest checkpoint (a check's end: every check saves one), never before it:
    # train_sft resumes from the newest checkpoint whatever ``steps`` says, so an earlier check would see later weights
    ckpt = latest_checkpoint(out / "checkpoints")
    end = checkpoint_step(ckpt) if ckpt is not None else 0
    acc = check(end) if end else 0.0
    while end < p.induction_steps and (end == 0 or acc < p.induction_target):
        end = min(end + every, p.induction_steps)
        acc = check(end)
    (out / "formed.json").write_text(json.dumps({"steps": end, "induction_acc": acc, "target": p.induction_target,
                                                 "reached": acc >= p.induction_target}))
    if acc < p.induction_target:  # not an error: the corpus phase may still make a base that copies (the probe says)
        log.info("pretrain: induction accuracy %.3f after the cap of %d steps, below the target %.2f", acc, end,
                 p.induction_target)


def train_base(model: torch.nn.Module, tokenizer: Any, samples: Sequence[Sample], p: PretrainConfig, out: Path, *,
               seed: int, metrics: Any = None) -> Any:
    """Stage 0's two phases on ``model`` in place: ``p.induction_steps`` steps on `induction_samples` (checkpoints in
    ``out/induction``, metrics stage ``pretrain/induction``), then ``p.steps`` on the corpus ``samples``
    (``out/checkpoints``, stage ``pretrain``); returns the corpus phase's `k3post.stages.sft.SFTResult`. Each phase
    resumes its own checkpoints: a run killed in phase 2 reloads phase 1's last one, then phase 2's."""
    if p.induction_steps:
        rows = induction_samples(tokenizer, p.induction_steps * p.rows_per_batch, p.seq_len, seed)
        if p.induction_target <= 0:
            train_sft(model, tokenizer, rows, induction_settings(p), Path(out) / "induction", seed=seed,
                      metrics=metrics, stage="pretrain/induction")
        else:
            _induction_until_formed(model, tokenizer, rows, p, Path(out) / "induction", seed, metrics)
    return train_sft(model, tokenizer, samples, sft_settings(p), out, seed=seed, metrics=metrics, stage="pretrain")


def _formed(folder: Path) -> dict[str, Any] | None:
    """Phase 1's outcome (``formed.json``: steps run, induction accuracy, target, reached), None without a stopping rule."""
    path = folder / "formed.json"
    return json.loads(path.read_text()) if path.is_file() else None


def build_base(cfg: K3Config, run: Path, metrics: Any) -> Path:
    """Stage 0 into ``run/pretrain`` (resuming its checkpoints), the probe logged to ``metrics`` (stage
    ``pretrain/probe``), the final model in ``run/pretrain/final`` with ``probe.json``, ``base_key.json`` and
    ``train.json``, then published to the cache (`publish_base`) unless ``pretrain.cache`` is off; returns
    the base's folder."""
    from k3post.models import build_tiny_moe, save_model

    p = cfg.pretrain
    key = base_key(cfg)
    out = run / "pretrain"
    torch.manual_seed(cfg.run.seed)
    docs = corpus_documents(p, cfg.run.seed)
    tokenizer = _tokenizer(cfg, docs, out / "tokenizer")
    samples = corpus_samples(tokenizer, docs, p.seq_len)
    n_tok = sum(len(s) for s in samples)
    log.info("pretrain corpus: %d documents, %d tokens (version %d)", len(samples), n_tok, CORPUS_VERSION)
    model = build_tiny_moe(len(tokenizer), cfg.model.preset, seed=cfg.run.seed, pad_token_id=tokenizer.pad_token_id,
                           eos_token_id=tokenizer.convert_tokens_to_ids("<|end_of_msg|>"),
                           max_position_embeddings=cfg.model.max_position_embeddings)
    res = train_base(model, tokenizer, samples, p, out, seed=cfg.run.seed, metrics=metrics)
    probe = copy_probe(model, tokenizer, p.probe_distances, p.probe_names, cfg.run.seed)
    if metrics is not None:
        metrics.log("pretrain/probe", p.steps, {f"copy_exact_{d}": r["exact"] for d, r in probe.items()}
                    | {f"copy_token_acc_{d}": r["token_acc"] for d, r in probe.items()})
    final = save_model(model, out / "final", tokenizer)
    (final / "probe.json").write_text(json.dumps({"settings": {"distances": list(p.probe_distances), "n": p.probe_names,
                                                               "seed": cfg.run.seed}, "result": probe}, indent=1))
    (final / "base_key.json").write_text(json.dumps({"key": key, "fields": base_key_fields(cfg)}, indent=1, default=str))
    (final / "train.json").write_text(json.dumps({"steps": res.steps, "final_loss": res.final_loss, "corpus_tokens": n_tok,
                                                  "tokens_per_step": p.rows_per_batch * p.seq_len,
                                                  "induction_steps": p.induction_steps,
                                                  "induction": _formed(out / "induction"),
                                                  "resumed_from": res.resumed_from}, indent=1))
    print(f"pretrain: {res.steps} steps, final loss {res.final_loss:.4f}, {res.wall_s:.0f} s, corpus {n_tok} tokens")
    print(format_probe(probe))
    _warn_copy(probe)
    if not p.cache:
        print(f"pretrained base: {final}")
        return final
    base = publish_base(final, cache_root(cfg) / "bases" / key)
    print(f"pretrained base (cached, key {key}): {base}")
    return base


def _warn_copy(probe: dict[str, Any]) -> None:
    msg = copy_warning(probe)
    if msg:
        log.warning(msg)
        print(f"WARNING: {msg}")


def run_pretrain(cfg: K3Config) -> Path:
    """`k3post pretrain CONFIG` (module doc); returns the base's folder (the cached one when caching)."""
    from k3post.metrics import MetricsLogger
    from k3post.runs import check_inputs, open_run

    if cfg.model.path:
        raise UserError("model.path: k3post pretrain builds model.preset from scratch; unset model.path")
    check_inputs(cfg, "pretrain")  # tokenizer.path, before it is hashed
    cached = cached_base(cfg)
    if cached is not None:
        probe = _probe_of(cached, cfg)
        print(format_probe(probe))
        _warn_copy(probe)
        print(f"pretrained base (cached, key {base_key(cfg)}): {cached}")
        return cached
    run = open_run(cfg.run.dir, cfg, "pretrain")
    metrics = MetricsLogger(run)
    try:
        return build_base(cfg, run, metrics)
    finally:
        metrics.close()
