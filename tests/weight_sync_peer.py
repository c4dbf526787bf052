"""The processes of the multi-process weight-sync test (tests/test_weight_sync.py).

    receive     an engine process: an EmbeddedEngine (QAT on) over the tiny Qwen3-MoE of seed 0 joins
                each session's group in turn (``DistributedReceiver``), takes every sync until the
                trainer closes the group or the group breaks, records after each sync its outcome, the
                engine's version and a digest of its weights; at the end a greedy generation. JSON to --out.
    crash-send  a trainer process that dies (exit code 17) right after broadcasting the first bucket.

The models: ``trainer_model(seed)``, the same in every process (fixed seed, QAT applied).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import types
from typing import Any

import torch

from k3post.distributed.weight_sync import DistributedReceiver, DistributedSync, WeightSyncError, named_weights
from k3post.models import build_tiny_moe
from k3post.quant.qat import QATConfig, apply_qat
from k3post.rollout.embedded import EmbeddedEngine
from k3post.rollout.engine import GenerationRequest, SamplingParams

VOCAB = 256
CRASH_CODE = 17
PROMPT = [5, 17, 42, 99, 3, 250]


def trainer_model(seed: int) -> torch.nn.Module:
    """The tiny Qwen3-MoE of ``seed`` with MX QAT applied."""
    model = build_tiny_moe(VOCAB, seed=seed)
    apply_qat(model, QATConfig())
    return model


def digest(model: torch.nn.Module) -> str:
    """sha256 over every synced tensor's name and bytes (equal digests: bit-identical weights)."""
    h = hashlib.sha256()
    for name, t in named_weights(model):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def greedy(engine: EmbeddedEngine) -> dict[str, Any]:
    [r] = engine.generate([GenerationRequest("g", list(PROMPT), SamplingParams(temperature=0.0, max_tokens=8, stop_ids=()))])
    return {"ids": list(r.output_ids), "logprobs": list(r.output_logprobs), "versions": list(r.output_versions)}


def _receive(args: argparse.Namespace) -> None:
    engine = EmbeddedEngine(trainer_model(0), qat=QATConfig(), max_batch_size=2, max_model_len=64)
    events: list[dict[str, Any]] = [{"session": -1, "ok": True, "version": engine.version, "digest": digest(engine.model)}]
    for i, init in enumerate(args.sessions.split(",")):
        receiver = DistributedReceiver(engine, init, args.rank, args.world, timeout_s=args.timeout)
        while True:
            try:
                stats = receiver.receive()
            except WeightSyncError as e:
                events.append({"session": i, "ok": False, "error": str(e), "version": engine.version, "digest": digest(engine.model)})
                if receiver.broken:
                    break
                continue
            if stats is None:
                break
            events.append({"session": i, "ok": True, "version": engine.version, "digest": digest(engine.model),
                           "stats": stats.as_dict()})
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"events": events, "greedy": greedy(engine)}, fh)


def _crash_send(args: argparse.Namespace) -> None:
    sync = DistributedSync(args.sessions, args.world, bucket_mb=args.bucket_mb, qat=QATConfig(), timeout_s=args.timeout)
    send = sync._send_bucket

    def send_first_then_die(self: DistributedSync, bucket: Any) -> None:
        send(bucket)
        sys.stdout.flush()
        os._exit(CRASH_CODE)

    sync._send_bucket = types.MethodType(send_first_then_die, sync)  # type: ignore[method-assign]
    sync.push(named_weights(trainer_model(args.seed)), args.version)
    raise AssertionError("the sender should have died after the first bucket")


def main() -> None:
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["receive", "crash-send"])
    ap.add_argument("--sessions", required=True, help="receive: comma-separated init methods; crash-send: one")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--out", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--version", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    (_receive if args.role == "receive" else _crash_send)(args)


if __name__ == "__main__":
    main()
