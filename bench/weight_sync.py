"""Benchmark: weight sync throughput (MB/s) per backend, from the trainer's weights into an engine.

What each number measures (``<set>_<arm>_mb_s_median`` / ``_min`` / ``_max`` over ``--repeats``
interleaved rounds, MB = 2**20 bytes of weights, fp32):
  * ``gloo``: ``DistributedSync.push`` from this process (rank 0) to ``--receivers`` engine processes
    (``DistributedReceiver`` + ``EmbeddedEngine``) over loopback: manifest, buckets of ``--bucket-mb``,
    the three votes and the receivers' apply; the push returns once every engine applied, so the
    time is the whole sync as the trainer sees it.
  * ``disk_write``: ``DiskSync.push`` (safetensors shards, fsync, sha256, rename);
    ``disk_read``: ``receive_from_disk`` into an engine in this process (sha256 check, load, apply).
    ``disk`` is the two together, i.e. a full sync through the file system.
  * ``in_process``: ``InProcessSync.push`` into a separate engine in this process (a copy per tensor;
    a co-located engine sharing the trainer's tensors copies nothing).
Weight sets: ``tiny`` (the calibration Qwen3-MoE, ~4 MB) and ``wide`` (a Qwen3-MoE with hidden 512,
4 layers, 8 experts of width 256: ~59 MB), both randomly initialised, no QAT.

Caveats: CPU loopback on a shared 2-core machine, so the sender, the receivers and the copies compete
for the same cores; gloo over loopback measures memory copies and the TCP stack, not a network; disk
reads come from the page cache (the folder was just written). Compare runs on one machine only.

Prints human-readable lines, then one final JSON line.

Usage: python bench/weight_sync.py [--repeats 5] [--bucket-mb 8] [--receivers 1] [--sets tiny,wide]

Shape legend: none.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from k3post.distributed.weight_sync import (
    MB,
    DiskSync,
    DistributedReceiver,
    DistributedSync,
    InProcessSync,
    named_weights,
    receive_from_disk,
)
from k3post.models import build_tiny_moe
from k3post.rollout.embedded import EmbeddedEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine_state, summary  # noqa: E402

SETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "wide": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=8),
}
VOCAB = 512


def _model(name: str, seed: int) -> torch.nn.Module:
    return build_tiny_moe(VOCAB, seed=seed, **SETS[name])


def _engine(name: str) -> EmbeddedEngine:
    return EmbeddedEngine(_model(name, 0), max_batch_size=1, max_model_len=16)


def _receive(args: argparse.Namespace) -> None:
    """A receiver process: an engine joins the group and takes syncs until the trainer closes it."""
    torch.set_num_threads(1)
    receiver = DistributedReceiver(_engine(args.set), args.init, args.rank, args.receivers + 1, timeout_s=600)
    while receiver.receive() is not None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_set(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    weights = named_weights(_model(name, 1))
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--role", "receive", "--set", name, "--init", init, "--rank", str(r),
                               "--receivers", str(args.receivers)], env=env) for r in range(1, args.receivers + 1)]
    try:
        gloo = DistributedSync(init, args.receivers + 1, bucket_mb=args.bucket_mb, timeout_s=600)
        local, disk_engine = _engine(name), _engine(name)
        disk = DiskSync(tmp / name, shard_mb=args.bucket_mb, keep=1)
        version = {"gloo": 0, "disk": 0, "in_process": 0}
        parts: dict[str, list[float]] = {"disk_write": [], "disk_read": []}

        def run_gloo() -> float:
            version["gloo"] += 1
            return gloo.push(weights, version["gloo"]).seconds

        def run_disk() -> float:
            version["disk"] += 1
            written = disk.push(weights, version["disk"])
            read = receive_from_disk(disk_engine, written.location or "")
            parts["disk_write"].append(written.seconds)
            parts["disk_read"].append(read.seconds)
            return written.seconds + read.seconds

        def run_in_process() -> float:
            version["in_process"] += 1
            return InProcessSync(local).push(weights, version["in_process"]).seconds

        times = interleaved({"gloo": run_gloo, "disk": run_disk, "in_process": run_in_process}, repeats=args.repeats)
        gloo.close()
        assert [p.wait(timeout=120) for p in procs] == [0] * len(procs), "a receiver process failed"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    times.update({k: v[1:] for k, v in parts.items()})  # the warm-up round is not a repeat
    out: dict[str, float] = {f"{name}_mb": nbytes / MB}
    for arm, secs in times.items():
        rates = [nbytes / MB / s for s in secs]
        out.update(summary(f"{name}_{arm}_mb_s", rates))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per arm (>= 1)")
    parser.add_argument("--bucket-mb", type=float, default=8.0, help="bucket (and disk shard) size in MB")
    parser.add_argument("--receivers", type=int, default=1, help="engine processes of the gloo arm")
    parser.add_argument("--sets", default="tiny,wide", help=f"comma-separated weight sets of {sorted(SETS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    parser.add_argument("--role", default="trainer", choices=["trainer", "receive"], help=argparse.SUPPRESS)
    parser.add_argument("--set", default="tiny", help=argparse.SUPPRESS)
    parser.add_argument("--init", default="", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "receive":
        _receive(args)
        return
    sets = args.sets.split(",")
    if args.repeats < 1 or args.receivers < 1 or any(s not in SETS for s in sets):
        raise ValueError(f"need --repeats >= 1, --receivers >= 1 and --sets from {sorted(SETS)}")
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    result: dict[str, Any] = {"bucket_mb": args.bucket_mb, "receivers": args.receivers, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sets:
            got = bench_set(name, args, Path(tmp))
            result.update(got)
            arms = ("gloo", "disk", "disk_write", "disk_read", "in_process")
            print(f"{name} ({got[name + '_mb']:.1f} MB): " + ", ".join(
                f"{a} {got[f'{name}_{a}_mb_s_median']:.0f} MB/s" for a in arms))
    result["caveats"] = ("CPU loopback on a shared machine: sender, receivers and copies share the cores; gloo measures "
                         "memory copies and the TCP stack, not a network; disk reads hit the page cache")
    result["wall_s"] = time.perf_counter() - t_start
    result["machine"] = machine_state()
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
