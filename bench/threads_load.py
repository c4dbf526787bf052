"""A fixed small workload, quiet and beside a CPU hog, at the thread policy's count and at torch's default.

    python bench/threads_load.py                       # SFT steps of the tiny MoE; hog on every core but one
    python bench/threads_load.py --hog-cores 1 --steps 6 --repeats 3 --json out.json
    python bench/threads_load.py --workers 2            # two copies at once, as the demo's SFT pair

The workload (``--workload sft``: ``--steps`` forward + backward + AdamW steps of the tiny Qwen3-MoE on a fixed
batch of ``--batch`` x ``--seq`` tokens; ``decode``: greedy decode steps, B = ``--batch``, over a KV cache) runs
in worker processes started once per arm (``--workers`` of them), so each arm's thread count is set once, before
torch starts, and the model is built once:

* ``policy``: what the ``k3post`` command runs: the count `k3post.threads` chooses for each of ``--workers``
  processes here (``run.threads: 0``, auto), with its OpenMP wait policy (`k3post.threads.quiet_waits`:
  idle workers sleep);
* ``torch``: torch's default in each (OMP_NUM_THREADS unset: the machine's cores; OMP_WAIT_POLICY unset:
  libgomp spins before it sleeps);
* ``torch_passive``: torch's default count with idle workers sleeping (OMP_WAIT_POLICY=PASSIVE): the wait
  policy alone, at the count a pinned ``run.threads`` equal to the cores runs;
* ``one``: one thread, for reference.

Each is timed quiet and beside a hog of ``--hog-cores`` busy-loop processes (one per core taken), arms
interleaved (`bench.common.interleaved`). Printed per arm: median seconds per step; per arm, the slowdown
loaded / quiet (median of paired ratios) against the share of cores the hog takes, cores / (cores - hog);
and the ratio torch / policy under load. The last line is JSON.

Caveats: a busy-loop hog is one kind of load (no memory traffic, no I/O); the machine's other work is not
controlled (its load averages are in the JSON); a few repeats of a few steps give ratios with wide spread
(min-max of paired repeats printed); when the policy's count equals torch's default (no affinity mask,
quota or OMP_NUM_THREADS cutting the cores), the two arms are the same setting and differ only by noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import machine_state  # noqa: E402


def worker(workload: str, steps: int, batch: int, seq: int) -> None:
    """Serve measurements in this process (thread count as the environment left it): build the model once, then
    for every line read on stdin run the workload and print one JSON line (median seconds per step, threads)."""
    import torch

    from k3post.models import build_tiny_moe

    torch.manual_seed(0)
    model = build_tiny_moe(512, "tiny", seed=0)
    ids = torch.randint(0, 512, (batch, seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def once() -> float:
        t0 = time.perf_counter()
        if workload == "sft":
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            with torch.no_grad():
                out = model(input_ids=ids, use_cache=True)  # prefill, then decode steps over the KV cache
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                t0 = time.perf_counter()
                model(input_ids=nxt, past_key_values=past, use_cache=True)
        return time.perf_counter() - t0

    once()  # warm-up (allocations), not timed
    print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
    for _ in sys.stdin:
        times = [once() for _ in range(steps)]
        print(json.dumps({"s_per_step": statistics.median(times), "threads": torch.get_num_threads()}), flush=True)


class Workers:
    """``n`` worker processes of one arm at ``threads`` (None: torch's default), started once and kept: a
    measurement asks all of them at once and waits for the slowest (a command waits for all its processes)."""

    def __init__(self, args: argparse.Namespace, threads: int | None, wait: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        if threads is not None:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        if wait is not None:
            env["OMP_WAIT_POLICY"] = wait
        cmd = [sys.executable, __file__, "--worker", "--workload", args.workload, "--steps", str(args.steps),
               "--batch", str(args.batch), "--seq", str(args.seq)]
        self.procs = [subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for _ in range(args.workers)]
        self.threads = [self._read(p)["threads"] for p in self.procs]

    @staticmethod
    def _read(p: subprocess.Popen) -> dict[str, Any]:
        line = p.stdout.readline() if p.stdout else ""
        if not line:
            raise RuntimeError(f"a worker exited ({p.wait()}) without an answer")
        return json.loads(line)

    def measure(self) -> dict[str, Any]:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        return max((self._read(p) for p in self.procs), key=lambda g: g["s_per_step"])

    def close(self) -> None:
        for p in self.procs:
            if p.stdin:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:  # a loaded machine: it has answered, so it may be stopped
                p.kill()
                p.wait()


class Hog:
    """``n`` busy-loop processes (one per core taken), started and stopped around a block."""

    def __init__(self, n: int) -> None:
        self.n, self.procs = n, []

    def __enter__(self) -> "Hog":
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(0.5)  # let them reach the loop
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def _paired(loaded: list[float], quiet: list[float]) -> dict[str, float]:
    r = [a / b for a, b in zip(loaded, quiet)]
    return {"median": round(statistics.median(r), 3), "min": round(min(r), 3), "max": round(max(r), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=["sft", "decode"], default="sft")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=1, help="copies of the workload running at once (a command's "
                   "processes: the demo's SFT pair, its RL domains, trainer ranks)")
    p.add_argument("--hog-cores", type=int, default=None, help="cores the hog takes (default: all usable but one)")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--json", default=None, help="also write the final JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq", "repeats", "workers"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.worker:
        worker(args.workload, args.steps, args.batch, args.seq)
        return 0

    from k3post.threads import WAIT_ENV, plan_threads, seen_cores

    cores = seen_cores()
    plan = plan_threads(cores, {"workload copies": args.workers})
    hog = max(1, cores.usable - 1) if args.hog_cores is None else args.hog_cores
    if hog < 1:
        p.error(f"--hog-cores must be >= 1, got {hog}")
    passive = WAIT_ENV[1]
    arms = {"policy": (plan.per_process, passive), "torch": (None, None), "torch_passive": (None, passive),
            "one": (1, None)}
    print(f"{args.workload}: {args.steps} steps, batch {args.batch} x {args.seq}; policy: {plan.describe()}; "
          f"hog: {hog} busy-loop process(es)")
    res: dict[str, dict[str, list[float]]] = {a: {"quiet": [], "loaded": []} for a in arms}
    pools = {a: Workers(args, t, w) for a, (t, w) in arms.items()}  # started quiet, kept for every measurement
    seen_threads = {a: w.threads[0] for a, w in pools.items()}
    try:
        for r in range(args.repeats):  # each repeat: every arm quiet, then every arm loaded, arm order rotated
            order = list(arms)[r % len(arms):] + list(arms)[: r % len(arms)]
            for cond in ("quiet", "loaded"):
                with Hog(hog) if cond == "loaded" else nullcontext():
                    for a in order:
                        m = pools[a].measure()
                        res[a][cond].append(m["s_per_step"])
                        print(f"  repeat {r}, {cond:6}, {a:6} ({m['threads']} threads): {m['s_per_step']:.4f} s/step "
                              f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    finally:
        for w in pools.values():
            w.close()
    share = cores.usable / (cores.usable - hog) if hog < cores.usable else None  # None: the hog takes every core
    out: dict[str, Any] = {"workload": args.workload, "steps": args.steps, "batch": args.batch, "seq": args.seq,
                           "repeats": args.repeats, "workers": args.workers, "hog_cores": hog, "usable_cores": cores.usable,
                           "threads": seen_threads, "core_share_slowdown": share and round(share, 3), "arms": {}}
    print(f"{'arm':8} {'threads':>7} {'quiet s/step':>12} {'loaded s/step':>13} {'slowdown (min-max)':>22}  "
          f"vs cores share {'n/a' if share is None else f'{share:.2f}x'}")
    for a in arms:
        q, ld = res[a]["quiet"], res[a]["loaded"]
        slow = _paired(ld, q)
        out["arms"][a] = {"quiet_s": [round(x, 4) for x in q], "loaded_s": [round(x, 4) for x in ld], "slowdown": slow}
        print(f"{a:8} {seen_threads[a]:7d} {statistics.median(q):12.4f} {statistics.median(ld):13.4f} "
              f"{slow['median']:8.2f} ({slow['min']:.2f}-{slow['max']:.2f})")
    out["loaded_torch_over_policy"] = _paired(res["torch"]["loaded"], res["policy"]["loaded"])
    out["quiet_torch_over_policy"] = _paired(res["torch"]["quiet"], res["policy"]["quiet"])
    out["loaded_torch_over_torch_passive"] = _paired(res["torch"]["loaded"], res["torch_passive"]["loaded"])
    out["quiet_torch_over_torch_passive"] = _paired(res["torch"]["quiet"], res["torch_passive"]["quiet"])
    out["policy_equals_torch_default"] = seen_threads["policy"] == seen_threads["torch"]
    out["machine"] = machine_state()
    print(f"loaded: torch default / policy {out['loaded_torch_over_policy']['median']:.2f} "
          f"({out['loaded_torch_over_policy']['min']:.2f}-{out['loaded_torch_over_policy']['max']:.2f}); "
          f"quiet: {out['quiet_torch_over_policy']['median']:.2f}"
          + ("  (same thread count: the difference is the wait policy)" if out["policy_equals_torch_default"] else ""))
    print(f"wait policy at torch's count: spinning / sleeping loaded {out['loaded_torch_over_torch_passive']['median']:.2f} "
          f"({out['loaded_torch_over_torch_passive']['min']:.2f}-{out['loaded_torch_over_torch_passive']['max']:.2f}), "
          f"quiet {out['quiet_torch_over_torch_passive']['median']:.2f} "
          f"({out['quiet_torch_over_torch_passive']['min']:.2f}-{out['quiet_torch_over_torch_passive']['max']:.2f})")
    line = json.dumps(out)
    if args.json:
        Path(args.json).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
