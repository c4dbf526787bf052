"""Can the base read? The copy probe of `k3post.stages.pretrain` on a model folder, or its curve over a pretraining run.

    python bench/copy_probe.py MODEL_DIR [--n 48] [--distances 20,100,300]
    python bench/copy_probe.py --train --steps 400 --every 50 [--seq-len 384] [--rows 8] [--preset tiny] [--induction-steps 1800]

MODEL_DIR: a model folder with its tokenizer (a cached base, `k3post pretrain` prints where). --train: pretrain
a fresh ``--preset`` on the generated corpus (`k3post.synth.corpus`; the tokenizer a byte-level BPE of
``--vocab`` trained on the documents only, so the run needs no family episodes), checkpoint every --every
steps, then probe each checkpoint: teacher-forced copy accuracy of held-out 2–3-token names restated 20 /
100 / 300 tokens after their introduction, against the steps and the training seconds they took (one torch
thread unless --threads). With --induction-steps N, at most N steps on induction rows
(`k3post.stages.pretrain.induction_samples`) come first, stopping once held-out induction accuracy reaches --induction-target
(0: all N on a cosine), as stage 0 runs them (`k3post.stages.pretrain.train_base`; the curve's steps count the corpus phase). The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from k3post.checkpoint import load_weights_into  # noqa: E402
from k3post.stages.pretrain import copy_probe, corpus_samples, format_probe, train_base  # noqa: E402


def train_curve(a: argparse.Namespace, distances: list[int]) -> list[dict]:
    from k3post.config.pretrain import PretrainConfig
    from k3post.models import build_tiny_moe
    from k3post.synth.corpus import document_text, generate_corpus
    from k3post.tokenizer import train_tokenizer

    p = PretrainConfig(steps=a.steps, n_docs=a.n_docs, seq_len=a.seq_len, rows_per_batch=a.rows, lr=a.lr,
                       warmup_steps=a.warmup, recall_share=a.recall_share, recent_share=a.recent_share, induction_steps=a.induction_steps, induction_target=a.induction_target, min_lr_ratio=a.min_lr_ratio, save_every=a.every, keep_last=a.steps // a.every + 1, progress=False)
    docs = generate_corpus(p.n_docs, a.seed, 4 * p.seq_len, recall_share=p.recall_share, recent_share=p.recent_share)
    tok = train_tokenizer([document_text(d) for d in docs[:2000]], vocab_size=a.vocab, word_boundaries=False)
    samples = corpus_samples(tok, docs, p.seq_len)
    layers = {"num_hidden_layers": a.layers} if a.layers else {}
    model = build_tiny_moe(len(tok), a.preset, seed=a.seed, pad_token_id=tok.pad_token_id, **layers)
    rows = [{"step": 0, "train_s": 0.0, "probe": copy_probe(model, tok, distances, a.n, a.seed)}]
    print(f"step 0: {format_probe(rows[0]['probe'])}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        res = train_base(model, tok, samples, p, Path(tmp), seed=a.seed)  # stage 0's phases (induction rows first)
        formed = Path(tmp) / "induction" / "formed.json"
        if formed.is_file():
            rows[0]["induction"] = json.loads(formed.read_text())
            print(f"induction phase: {rows[0]['induction']}", flush=True)
        for step in range(a.every, a.steps + 1, a.every):
            load_weights_into(model, Path(tmp) / "checkpoints" / f"step-{step:06d}")
            row = {"step": step, "train_s": round(res.wall_s * step / a.steps, 1),
                   "probe": copy_probe(model, tok, distances, a.n, a.seed)}
            print(f"step {step} ({row['train_s']:.0f} s): {format_probe(row['probe'])}", flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--n", type=int, default=48, help="held-out names per distance")
    ap.add_argument("--distances", default="20,100,300")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--n-docs", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0: keep it)")
    ap.add_argument("--recall-share", type=float, default=0.45)
    ap.add_argument("--recent-share", type=float, default=0.0)
    ap.add_argument("--induction-steps", type=int, default=0, help="phase 1: at most this many steps on induction rows")
    ap.add_argument("--induction-target", type=float, default=0.9, help="phase 1 stops at this induction accuracy")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--preset", default="tiny")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    distances = [int(x) for x in a.distances.split(",")]
    if a.train:
        out = {"curve": train_curve(a, distances), "args": vars(a)}
    elif a.model:
        from k3post.models import load_model
        from k3post.tokenizer import load_tokenizer

        probe = copy_probe(load_model(a.model), load_tokenizer(a.model), distances, a.n, a.seed)
        print(format_probe(probe))
        out = {"model": a.model, "probe": probe}
    else:
        ap.error("give a MODEL_DIR or --train")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
