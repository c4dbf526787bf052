"""``coding.kernel``: make a reference operator faster; correctness gates, measured speed scores (SPEC §3.5).

The prompt shows a plain-Python reference operator (`ops.OPS`: softmax, layer norm, fused
matmul + bias + ReLU, a row reduction, a 5-point stencil) on flat ``array.array`` buffers of one
dtype (``"d"`` float64 or ``"f"`` float32). The agent writes ``kernel.py`` defining the same
function, vectorised Python or C: every ``*.c`` file of the working directory is compiled by the
harness with the system compiler (``gcc -O3 -march=native -shared -fPIC -lm`` into
``lib<stem>.so``) and ``kernel.py`` loads it through ``ctypes``. Tools: ``write_file``,
``read_file``, ``list_files``, ``run_python`` and ``run_tests`` (the verifier's harness on public
inputs: correctness and a score estimate).

Verification (`verify_kernel`, `measure`; issue 30 redesigned it) trusts nothing the agent's process can touch:

1. the agent's ``*.c`` are compiled in a **fresh sandbox** holding only its files; a second, trusted sandbox
   (its own uid) holds the shipped expert (the same ``kernel.py`` + ``kernel.c`` loader the reference
   solver writes), the plain-Python reference (run by two children: the reference and its control), a null kernel (allocates a zero result: the harness's own cost)
   and the roofline calibration kernels, which run there alone (`CALIBRATE`);
2. every implementation runs in **its own child process** (`k3post.envs.kernel_child`), started by
   `Sandbox.spawn`: pid 1 alone in its own PID namespace, so the agent's child sees no other process (its
   parent pid reads 0: no ``/proc/<ppid>/mem``, no ptrace, no signal) and holds no nonce, no expert, no
   reference, no timing state and no input but those of its own calls. The child locks ``RLIMIT_NPROC`` to
   0 before it imports ``kernel`` (no thread, no process: all of its work is on its own CPU clock);
3. the inputs are drawn from `secrets` **after** the agent's child has loaded its code; they travel in a
   sealed shared-memory block per child (size fixed, so the child cannot make the parent's mapping fault);
4. each call: the parent puts the inputs in place while the child is stopped (``SIGSTOP``), reads the child's
   CPU clock, continues it, reads its whole reply, stops it, waits until it is stopped and reads the clock
   again. Everything the child does between the two readings counts: decoding, the call, and
   **materialising the result, which must be exactly an ``array.array`` of the typecode or exactly a
   ``list``** (a lazy iterable, an array or list subclass, anything else is an ``output`` error). Children
   are pinned to one CPU (a child that changes its own affinity is rejected: ``affinity``) and are stopped whenever
   they are not being timed;
5. the hidden correctness cases (the task's shape, an odd shape, NaN / ±Inf entries, large magnitudes) run
   first, then `WARMUP` untimed and `ROUNDS` timed rounds; a round is `BATCH` fresh input sets in one call
   (sharing the fixed cost of a call), given to the reference, its control, the expert, the null kernel and the agent in
   an order that rotates every role through every position (`ROUND_ORDERS`: a role's place in the round
   biases no ratio). **Every** result of the agent (cases, warm-up, timed) is compared with the reference
   child's on the same inputs (after the round when the agent ran first), and every call echoes its inputs as
   the kernel left them (modified inputs are a hack).

Speed score (`speed_score`), with ``t`` the agent's median time and ``t_exp = t · median_i(exp_i / t_i)`` the
expert's time paired with the agent's round by round (a burst of load that slows one round slows every role in it;
unpaired medians let a reference copy score under load: issue 31, test_every_hack_scores_zero), ``t_ref`` the faster
of the two reference children's times paired the same way and ``spread`` the |log| of their ratio (the same code
timed twice in the same rounds: under load 4.4 one reference child read 1.58x slower than a copy of it over all
eight rounds of a measurement, with a paired noise of only 0.08: decisions §kernelload), ``noise`` the largest of
the paired ratios' MADs (in log),
and the roofline time ``t_roof = max(bytes / bandwidth, flops / flop_rate)`` from the calibration
kernels measured in the trusted sandbox on a buffer of the task's size, ``s = t_ref / t`` (speedup),
``s_e = t_ref / t_exp``, ``q = t_exp / t`` and the parity band ``b = clip(3 * noise, MIN_BAND, 0.5)`` (`MIN_BAND` 0.25)::

    s <= g                     -> 0                      (not clearly faster than the reference)
    q <  1 / (1 + b)           -> 0.5 * log(s / g) / log(s_e / (g * (1 + b)))
    1 / (1 + b) <= q <= 1 + b  -> 0.5                    (parity with the expert)
    q >  1 + b                 -> 0.5 + 0.5 * min(1, log(q / (1 + b)) / log(R / (1 + b))),
                                  R = max(t_exp / t_roof, (1 + b)^2)

with the reference gate ``g = max(REF_GATE · e^spread, 1 + b)`` (`REF_GATE` 1.5: the same Python code timed twice
differs by up to ~1.2x; a measurement whose noise exceeds `NOISE_RERUN` or whose spread exceeds `SPREAD_RERUN` is
repeated, up to `MAX_RUNS`, and the least noisy one scored), so the
reward is continuous and non-decreasing in the measured speedup, 0.5 at parity with the
shipped expert and 1 at the roofline (which includes neither Python's call overhead nor the harness's
cost per call, both in every measured time, so it is approached, not reached). The reference solver ships the expert itself and scores exactly 0.5: the "reference
solvers score 1" standard does not fit a speed-graded reward (docs/decisions.md).

The sandbox's interpreter is the system ``/usr/bin/python3`` (stdlib only: the host interpreter's
prefix is not readable by the sandbox uid), so operators are plain Python on ``array.array``
buffers rather than numpy / PyTorch, and fast kernels are C through ``ctypes``. Triton variants need
a GPU and are not implemented.
"""

from __future__ import annotations

import array
import json
import math
import os
import random
import secrets
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from k3post.envs.env import EpisodeLimits, ToolEnvironment
from k3post.envs.families.common import FamilyBase, assistant
from k3post.envs.families.kernel.ops import CALIBRATION_C, OPS, KernelOp
from k3post.envs.families.registry import register_family
from k3post.envs.kernel_child import ChildError, KernelChild
from k3post.envs.sandbox import Sandbox, SandboxLimits
from k3post.envs.sandbox_tools import TOOLS, SandboxState, clip, final_text_files, make_env, script_call
from k3post.envs.task import FinalState, Task, Verdict, register_verifier
from k3post.envs.tools import ToolContext, ToolSpec

__all__ = [
    "CALIBRATE",
    "KERNEL",
    "KernelFamily",
    "Measurement",
    "ROUND_ORDERS",
    "RTOL",
    "compare",
    "expert_files",
    "measure",
    "paired_times",
    "score",
    "speed_score",
    "verify_files",
    "verify_kernel",
]

KERNEL_PY = "kernel.py"
RTOL = {"d": 1e-9, "f": 1e-4}
"""Relative tolerance per dtype; the absolute part is ``rtol * max|want|`` (see `compare`)."""
ROUNDS = 10
"""Timed rounds (each times the reference, its control copy, the expert, the agent and the null kernel on the same
fresh inputs); a multiple of the number of roles, so `ROUND_ORDERS` balances the positions."""
WARMUP = 3
"""Untimed rounds before them (CPython specialises a function's bytecode after a few calls)."""
TRUSTED_CALL_S = 120.0
"""Time limit of one call of a trusted child (its own, not the measurement's: the agent cannot use it up)."""
BATCH = 8
"""Input sets per timed call: the child's fixed cost per call (wake-up, frames) is shared by this many calls."""
NOISE_RERUN = 0.10
"""Timing noise (MAD of the paired log ratios) above which the measurement is repeated."""
REF_GATE = 1.5
"""Speedups over the reference up to this score 0 (see `speed_score`)."""
MIN_BAND = 0.25
"""Smallest parity band: the expert's own code in the agent's seat measured 0.85-1.15x the expert (24 verifications
of row_sumsq, quiet and with both cores busy; docs/decisions.md §kernelband), which a band of 0.15 (0.87-1.15x) cut."""
MAX_RUNS = 3
SPREAD_RERUN = math.log(1.15)
"""Control spread (|log| of the two reference children's paired times) above which the measurement is repeated."""
ROLES = ("ref", "agent", "expert", "null", "control")
ROUND_ORDERS = tuple(tuple(ROLES[(i // 2 + j) % len(ROLES)] for j in range(len(ROLES))) if i % 2 == 0 else
                     tuple(ROLES[(i // 2 - j) % len(ROLES)] for j in range(len(ROLES))) for i in range(2 * len(ROLES)))
"""The order of the roles in round i (``ROUND_ORDERS[i % 10]``): every rotation of the roles forwards and backwards,
so any ten consecutive rounds (`ROUNDS`) put every role in every position twice and no role's place in the round
biases a paired ratio."""
VERIFY_LIMITS = SandboxLimits(cpu_s=60.0, wall_s=120.0, memory_bytes=1024**3, max_output_bytes=32 * 1024**2,
                              nproc=64)
_CTYPE = {"d": "double", "f": "float"}

# --------------------------------------------------------------------------- the trusted sandbox (stdlib only)

GCC = ("gcc", "-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC")
CALIBRATE = r'''
import array, ctypes, json, sys, time
lib = ctypes.CDLL("./libcalib.so")
lib.k3_fma.restype = ctypes.c_double
n = max(1024, int(sys.argv[1]) // 8)
src, dst = array.array("d", bytes(8 * n)), array.array("d", bytes(8 * n))
ps, pd = ctypes.c_void_p(src.buffer_info()[0]), ctypes.c_void_p(dst.buffer_info()[0])
best_copy = best_fma = None
for _ in range(7):
    t0 = time.perf_counter_ns(); lib.k3_copy(ps, pd, ctypes.c_long(n)); dt = time.perf_counter_ns() - t0
    best_copy = dt if best_copy is None else min(best_copy, dt)
    t0 = time.perf_counter_ns(); lib.k3_fma(ctypes.c_long(20000)); dt = time.perf_counter_ns() - t0
    best_fma = dt if best_fma is None else min(best_fma, dt)
print(json.dumps({"bandwidth": 16.0 * n / max(best_copy, 1) * 1e9, "flop_rate": 64.0 * 20000 / max(best_fma, 1) * 1e9}))
'''
"""The roofline calibration, run in the trusted sandbox (no agent code there): best of 7 wall times."""


def _compile(sb: Sandbox, timeout: float) -> str | None:
    """Compile every top-level ``*.c`` of ``sb`` into ``lib<stem>.so``; the first compiler error, or None."""
    for name in sb.list_files():
        if name.endswith(".c") and "/" not in name:
            res = sb.run([*GCC, "-o", f"lib{name[:-2]}.so", name, "-lm"], timeout=timeout)
            if res.returncode != 0:
                return f"{name}: {res.stderr[-1500:] or res.killed_reason}"
    return None


def _trusted_files(op: KernelOp, tc: str) -> dict[str, str]:
    """The trusted sandbox: the expert (``kernel.py`` + ``kernel.c``), the reference, the null kernel, calibration."""
    return {**expert_files(op, tc), "reference.py": op.reference, "null.py": f"import array\n\n\ndef {op.name}({', '.join(op.args + op.dims)}):\n"
            f"    return array.array({tc!r}, bytes({array.array(tc).itemsize} * ({op.out_expr})))\n",
            "calib.c": CALIBRATION_C}


# --------------------------------------------------------------------------- inputs, references, comparison


def _random_inputs(op: KernelOp, dims: Mapping[str, int], tc: str, rng: random.Random, *, scale: float = 1.0,
                   specials: bool = False) -> list[array.array]:
    """Random input buffers; ``specials`` plants NaN, +Inf and -Inf at a few positions of the first buffer."""
    gen = np.random.default_rng(rng.getrandbits(128))
    bufs = []
    for n in op.inputs(dict(dims)):
        vals = gen.uniform(-1.0, 1.0, n) * (op.scale * scale)
        bufs.append(array.array(tc, vals.astype(np.float64 if tc == "d" else np.float32).tobytes()))
    if specials:
        first = bufs[0]
        for v in (math.nan, math.inf, -math.inf, math.nan):
            first[rng.randrange(len(first))] = v
    return bufs


def _reference_fn(op: KernelOp) -> Callable[..., list[float]]:
    ns: dict[str, Any] = {}
    exec(compile(op.reference, f"<{op.name} reference>", "exec"), ns)  # noqa: S102 - our own reference code
    return ns[op.name]


def _expected(op: KernelOp, args: Sequence[array.array], dims: Mapping[str, int], tc: str) -> array.array:
    """The reference output on the host, rounded to the task's dtype."""
    return array.array(tc, _reference_fn(op)(*[array.array(tc, a) for a in args], *[dims[d] for d in op.dims]))


def compare(got: Sequence[float], want: Sequence[float], tc: str) -> str | None:
    """None when ``got`` matches ``want``, else the first mismatch in words.

    Same length; NaN exactly where ``want`` is NaN; ±Inf exactly where ``want`` is; elsewhere a finite
    value with ``|got - want| <= rtol * (|want| + max|want|)`` (``rtol`` `RTOL` of dtype ``tc``).
    """
    if len(got) != len(want):
        return f"the result has {len(got)} values, expected {len(want)}"
    rtol = RTOL[tc]
    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    finite = np.isfinite(w)
    scale = float(np.max(np.abs(w[finite]))) if finite.any() else 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        ok = np.where(np.isnan(w), np.isnan(g),
                      np.where(finite, np.isfinite(g) & (np.abs(g - w) <= rtol * (np.abs(w) + scale)), g == w))
    if ok.all():
        return None
    i = int(np.argmin(ok))
    gi, wi = float(g[i]), float(w[i])
    if not math.isfinite(wi):
        return f"value {i}: got {gi!r}, expected {wi!r}"
    return f"value {i}: got {gi!r}, expected {wi!r} (rtol {rtol:g})"


# --------------------------------------------------------------------------- the score


def speed_score(t_ref: float, t_expert: float, t_agent: float, t_roof: float, band: float = 0.1,
                gate: float = REF_GATE) -> float:
    """The speed part of the reward (module docstring): 0.5 at parity with the expert, 1 at the roofline.

    Args: median seconds of the reference, the expert and the agent, the roofline time, the parity band
    ``b`` (relative) and the reference gate ``g`` (speedups up to ``max(g, 1 + b)`` score 0).
    Non-decreasing in ``t_ref / t_agent`` for fixed other times.
    """
    if min(t_ref, t_expert, t_agent, t_roof) <= 0 or band < 0 or gate < 1:
        raise ValueError("speed_score needs positive times, a non-negative band and a gate >= 1")
    s, s_e, q, hi = t_ref / t_agent, t_ref / t_expert, t_expert / t_agent, 1.0 + band
    g = max(gate, hi)
    if s <= g or s_e <= g * hi:
        return 0.0
    if q < 1.0 / hi:
        return 0.5 * min(1.0, math.log(s / g) / math.log(s_e / (g * hi)))
    if q <= hi:
        return 0.5
    r = max(t_expert / t_roof, hi * hi)
    return 0.5 + 0.5 * min(1.0, math.log(q / hi) / math.log(r / hi))


@dataclass(frozen=True)
class Measurement:
    """One harness run's outcome: an error (``error`` and ``why``) or times (the agent's median, the reference's
    and the expert's paired with it: module docstring), noise and the roofline time."""

    error: str | None = None
    why: str = ""
    t_ref: float = 0.0
    t_expert: float = 0.0
    t_agent: float = 0.0
    t_roof: float = 0.0
    noise: float = 0.0
    weak_isolation: bool = False
    t_null: float = 0.0  # the null kernel: the harness's own cost per call (decode, call, send), in every time
    wall_s: float = 0.0  # the measurement's wall time
    spread: float = 0.0  # |log| of the two reference children's paired times: same code, timed twice, right now


def _public_cases(task: Task) -> list[tuple[list[array.array], dict[str, int]]]:
    """The public correctness case of `run_tests` (fixed by the task's public seed: the agent may see it)."""
    md = task.metadata
    op, tc = OPS[md["op"]], md["typecode"]
    rng = random.Random(f"{md['public_seed']}:0")
    return [(_random_inputs(op, md["public_dims"], tc, rng), dict(md["public_dims"]))]


def _hidden_cases(task: Task, rng: random.Random) -> list[tuple[list[array.array], dict[str, int]]]:
    """The hidden correctness cases: the task's shape, an odd shape, NaN / ±Inf entries, large magnitudes."""
    md = task.metadata
    op, tc, dims = OPS[md["op"]], md["typecode"], dict(md["dims"])
    odd = dict(op.odd)
    return [(_random_inputs(op, dims, tc, rng), dims), (_random_inputs(op, odd, tc, rng), odd),
            (_random_inputs(op, dims, tc, rng, specials=True), dims),
            (_random_inputs(op, dims, tc, rng, scale=100.0), dims)]


class _Reject(Exception):
    def __init__(self, kind: str, why: str) -> None:
        super().__init__(f"{kind}: {why}")
        self.kind, self.why = kind, why


def _checked_call(child: KernelChild, op: KernelOp, tc: str, sets: Sequence[Sequence[array.array]],
                  dims: Mapping[str, int], where: str, timeout: float, want: Sequence[array.array] | None = None) -> int:
    """One call of the agent's child on ``sets`` of inputs, every result checked (`_check_outputs`); the child's
    CPU nanoseconds. ``want``: the expected results; by default the reference is run here."""
    sent, outs, echoes, ns = _agent_call(child, op, sets, dims, timeout)
    _check_outputs(op, tc, sets, sent, outs, echoes, dims, where, want)
    return ns


def _agent_call(child: KernelChild, op: KernelOp, sets: Sequence[Sequence[array.array]], dims: Mapping[str, int],
                timeout: float) -> tuple[list[list[bytes]], list[bytes], list[bytes], int]:
    """One unchecked call of the agent's child: (the input bytes sent, its results, its echoed inputs, its CPU
    nanoseconds); `_check_outputs` judges them."""
    sent = [[a.tobytes() for a in args] for args in sets]
    outs, echoes, ns = child.call(sent, [dims[k] for k in op.dims], timeout=timeout)
    return sent, outs, echoes, ns


def _check_outputs(op: KernelOp, tc: str, sets: Sequence[Sequence[array.array]], sent: Sequence[Sequence[bytes]],
                   outs: Sequence[bytes], echoes: Sequence[bytes], dims: Mapping[str, int], where: str,
                   want: Sequence[array.array] | None) -> None:
    """Every input echoed unchanged and every result equal to ``want`` (the trusted reference child's results on
    the same inputs; None: the reference run here) within the dtype's tolerance, else `_Reject`."""
    for k, (args, raw, out, echo) in enumerate(zip(sets, sent, outs, echoes)):
        if echo != b"".join(raw):
            raise _Reject("mutated", "the kernel modified its input buffers")
        got = array.array(tc)
        if len(out) % got.itemsize:
            raise _Reject("mismatch", f"{where}: the result has {len(out)} bytes, not a whole number of values")
        got.frombytes(out)
        bad = compare(got, want[k] if want is not None else _expected(op, args, dims, tc), tc)
        if bad:
            raise _Reject("mismatch", f"{where}: {bad}")


def _trusted_call(child: KernelChild, role: str, op: KernelOp, sets: Sequence[Sequence[array.array]],
                  dims: Mapping[str, int]) -> tuple[list[bytes], int]:
    """A call of a trusted child (reference, expert, null): its failure is the verifier's, never the agent's."""
    try:
        outs, _, ns = child.call([[a.tobytes() for a in args] for args in sets], [dims[k] for k in op.dims],
                                 timeout=TRUSTED_CALL_S)
    except ChildError as exc:
        raise RuntimeError(f"coding.kernel: the trusted {role} child failed ({exc.kind}): {exc.why[-500:]}") from exc
    return outs, ns


def _shm_bytes(op: KernelOp, tc: str, shapes: Sequence[Mapping[str, int]]) -> int:
    """Shared memory per child: `BATCH` input sets and their echo, plus room for results up to 4x too long."""
    size = array.array(tc).itemsize
    need = max(2 * sum(op.inputs(dict(d))) + 4 * op.outputs(dict(d)) for d in shapes) * size * BATCH
    return -(-(need + 4096) // 4096) * 4096


def _pin_cpu() -> int:
    """The CPU every child of a measurement is pinned to (the last one this process may use)."""
    return max(os.sched_getaffinity(0))


def measure(task: Task, sandbox: Sandbox, *, run: int = 0, public: bool = False, timeout: float = 100.0) -> Measurement:
    """Compile and load the agent's files in ``sandbox``, time them against the expert and check every output.

    The structure (module docstring): the agent's ``kernel.py`` runs in its own child in ``sandbox``; the
    reference, the expert and the null kernel in children of a fresh trusted sandbox; every child is pinned to
    one CPU, stopped between calls and timed on its own CPU clock by this process (`KernelChild`). Inputs are
    drawn from `secrets` after the agent's child has loaded its code; every output of the agent's child (the
    correctness cases, the warm-up calls and the timed rounds) is compared with the reference. ``run`` only
    numbers the attempt (inputs are fresh on every run).
    """
    del run
    md = task.metadata
    op, tc, dims = OPS[md["op"]], md["typecode"], dict(md["dims"])
    weak = sandbox.weak_isolation
    start = time.monotonic()
    deadline = start + timeout
    n_warm, n_rounds = (2, 3) if public else (WARMUP, ROUNDS)
    bad = _compile(sandbox, max(1.0, deadline - time.monotonic()))
    if bad:
        return Measurement("compile", bad, weak_isolation=weak)
    children: list[KernelChild] = []
    try:
        with Sandbox(limits=VERIFY_LIMITS) as trusted:
            for path, text in _trusted_files(op, tc).items():
                trusted.write_file(path, text)
            why = _compile(trusted, 60.0)
            if why:
                raise RuntimeError(f"coding.kernel: the shipped kernels do not compile: {why}")
            n_bytes = array.array(tc).itemsize * (sum(op.inputs(dims)) + op.outputs(dims))
            res = trusted.run(["python", "-I", "-B", "-c", CALIBRATE, str(n_bytes)], timeout=60.0)
            if res.returncode != 0:
                raise RuntimeError(f"coding.kernel: calibration failed: {res.stderr[-500:]}")
            cal = json.loads(res.stdout)
            cpu = _pin_cpu()
            capacity = _shm_bytes(op, tc, [dims, dict(op.odd), dict(md["public_dims"])])
            agent = KernelChild(sandbox, tc, op.name, "kernel", capacity=capacity, cpu=cpu,
                                start_timeout=max(1.0, deadline - time.monotonic()))
            children.append(agent)
            roles = {"agent": agent}
            for role, module in (("ref", "reference"), ("control", "reference"), ("expert", "kernel"), ("null", "null")):
                try:
                    roles[role] = KernelChild(trusted, tc, op.name, module, capacity=capacity, cpu=cpu)
                except ChildError as exc:
                    raise RuntimeError(f"coding.kernel: the trusted {role} child did not start: {exc}") from exc
                children.append(roles[role])
            # drawn now: the agent's code is loaded and nothing it ran could have seen these
            rng = random.Random(secrets.randbits(128))

            def left() -> float:
                return max(0.5, deadline - time.monotonic())

            for i, (args, d) in enumerate(_public_cases(task) if public else _hidden_cases(task, rng)):
                _checked_call(agent, op, tc, [args], d, f"case {i}", left())
            times: dict[str, list[int]] = {r: [] for r in roles}
            for i in range(n_warm + n_rounds):  # fresh inputs per round (BATCH sets); every role gets the same
                sets = [_random_inputs(op, dims, tc, rng) for _ in range(BATCH)]
                # every role in every position (ROUND_ORDERS); the agent's results are checked against the
                # reference child's once both have run
                want: list[array.array] = []
                agent_reply: tuple[list[list[bytes]], list[bytes], list[bytes]] | None = None
                for role in ROUND_ORDERS[i % len(ROUND_ORDERS)]:
                    if role == "agent":
                        sent, outs, echoes, ns = _agent_call(agent, op, sets, dims, left())
                        agent_reply = (sent, outs, echoes)
                    else:
                        outs, ns = _trusted_call(roles[role], role, op, sets, dims)
                        if role == "ref":
                            want = [array.array(tc, o) for o in outs]
                    if i >= n_warm:
                        times[role].append(max(ns, 1))
                assert agent_reply is not None
                _check_outputs(op, tc, sets, *agent_reply, dims, f"timed round {i}", want)
                if time.monotonic() > deadline:
                    raise _Reject("timeout", f"the measurement ran past its {timeout:g} s")
    except ChildError as exc:
        return Measurement(exc.kind, exc.why, weak_isolation=weak)
    except _Reject as exc:
        return Measurement(exc.kind, exc.why, weak_isolation=weak)
    finally:
        for child in children:
            child.close()
    t = {k: [v * 1e-9 / BATCH for v in vals] for k, vals in times.items()}  # seconds per call
    p = paired_times(t)
    t_roof = max(n_bytes / cal["bandwidth"], op.flops(dims) / cal["flop_rate"])
    return Measurement(None, "", p.t_ref, p.t_expert, p.t_agent, t_roof, p.noise, weak, statistics.median(t["null"]),
                       time.monotonic() - start, p.spread)


@dataclass(frozen=True)
class Paired:
    """`paired_times`'s result: times in seconds, ``noise`` and ``spread`` as |log| ratios."""

    t_ref: float
    t_expert: float
    t_agent: float
    noise: float
    spread: float


def paired_times(times: Mapping[str, Sequence[float]]) -> Paired:
    """Paired times of per-round times (``times[role][i]``: role's time in round i; roles ``agent``, ``ref``,
    ``control``, ``expert``). Each of ``ref``, ``control`` and ``expert`` is paired with the agent: the agent's
    median times the role's median ratio to the agent in the same round. ``t_ref`` is the faster of the two
    reference children (so speed_score's s = t_ref / t_agent and q = t_expert / t_agent are paired ratios),
    ``spread`` the |log| of their ratio (the same code timed twice in the same rounds) and ``noise`` the largest
    MAD of the three log ratios."""
    t_agent = statistics.median(times["agent"])
    paired, noise = {}, 0.0
    for role in ("ref", "control", "expert"):
        logr = [math.log(x / a) for x, a in zip(times[role], times["agent"], strict=True)]
        mid = statistics.median(logr)
        paired[role] = t_agent * math.exp(mid)
        noise = max(noise, statistics.median(abs(x - mid) for x in logr))
    return Paired(min(paired["ref"], paired["control"]), paired["expert"], t_agent, noise,
                  abs(math.log(paired["ref"] / paired["control"])))


def _kernel_files(state: Any) -> dict[str, str]:
    """The final ``.py`` and ``.c`` files (path -> text) of a `SandboxState` or a JSON ``{"files"|"snapshot"}``."""
    files = final_text_files(state, lambda p: p.endswith((".py", ".c")) and "/" not in p, "kernel verifier")
    return {p: t for p, t in files.items() if len(t) <= 100_000}


Measurer = Callable[[Task, Mapping[str, str], int], Measurement]


def _measure_fresh(task: Task, files: Mapping[str, str], run: int) -> Measurement:
    with Sandbox(limits=VERIFY_LIMITS) as sb:
        for path, text in files.items():
            sb.write_file(path, text)
        return measure(task, sb, run=run)


def score(m: Measurement) -> tuple[float, dict[str, float]]:
    """Reward and components of a successful measurement: the parity band from the noise, the reference gate
    `REF_GATE` widened by the control's spread (two children of the same code that read ``e^spread`` apart right
    now say a third copy may too)."""
    band = min(0.5, max(MIN_BAND, 3.0 * m.noise))
    gate = REF_GATE * math.exp(m.spread)
    reward = speed_score(m.t_ref, m.t_expert, m.t_agent, m.t_roof, band, gate)
    return reward, {"correct": 1.0, "speedup": m.t_ref / m.t_agent, "vs_expert": m.t_expert / m.t_agent,
                    "expert_speedup": m.t_ref / m.t_expert, "roofline_speedup": m.t_ref / m.t_roof,
                    "noise": m.noise, "band": band, "spread": m.spread, "gate": gate}


def _badness(m: Measurement) -> float:
    """How far a measurement is past its re-run thresholds (> 1: repeat it)."""
    return max(m.noise / NOISE_RERUN, m.spread / SPREAD_RERUN)


def verify_files(task: Task, files: Mapping[str, str], *, measurer: Measurer | None = None) -> Verdict:
    """Measure ``files`` (fresh sandbox per run, re-run while noisy or while the control spreads) and score them; ``measurer`` is injectable."""
    if KERNEL_PY not in files:
        return Verdict(0.0, {"correct": 0.0}, f"no {KERNEL_PY} in the final working directory")
    measurer = measurer or _measure_fresh
    best: Measurement | None = None
    runs = 0
    for run in range(MAX_RUNS):
        m = measurer(task, files, run)
        runs += 1
        if m.error is not None:
            return Verdict(0.0, {"correct": 0.0}, f"{m.error}: {m.why}", m.weak_isolation)
        if best is None or _badness(m) < _badness(best):
            best = m
        if _badness(best) <= 1.0:
            break
    assert best is not None
    reward, comps = score(best)
    comps["runs"] = float(runs)
    diag = (f"correct; {comps['speedup']:.1f}x the reference, {comps['vs_expert']:.2f}x the expert "
            f"(expert {comps['expert_speedup']:.1f}x, roofline {comps['roofline_speedup']:.0f}x), noise {best.noise:.3f}, "
            f"control spread {best.spread:.3f}")
    return Verdict(reward, comps, diag, best.weak_isolation)


@register_verifier("coding.kernel")
def verify_kernel(task: Task, final: FinalState) -> Verdict:
    """0 unless every hidden and timed output matches the reference and no hack is detected; else `speed_score`."""
    return verify_files(task, _kernel_files(final.state))


# --------------------------------------------------------------------------- tools, solutions, hacks


def _run_tests(ctx: ToolContext) -> str:
    """The verifier's harness on public inputs in the working sandbox: correctness and a score estimate."""
    assert ctx.task is not None
    state = ctx.state
    if not isinstance(state, SandboxState):
        raise ValueError("run_tests needs a kernel environment state")
    if KERNEL_PY not in state.sandbox.list_files():
        return f"FAIL: {KERNEL_PY} does not exist yet. Write it with write_file."
    m = measure(ctx.task, state.sandbox, public=True, timeout=30.0)
    if m.error is not None:
        return clip(f"FAIL ({m.error}): {m.why}")
    reward, comps = score(m)
    return (f"PASS: outputs match the reference on the public inputs. Speedup over the reference "
            f"{comps['speedup']:.1f}x; estimated score {reward:.2f} (public inputs, 3 rounds).")


_RUN_TESTS = ToolSpec("run_tests", "Compile *.c, check kernel.py against the reference on public inputs and time it.",
                      {"type": "object", "additionalProperties": False, "properties": {}}, read_only=True,
                      handler=_run_tests)
TOOL_NAMES = ("write_file", "read_file", "list_files", "run_python", "run_tests")


def _library() -> dict[str, ToolSpec]:
    return {**{n: TOOLS[n] for n in TOOL_NAMES if n != "run_tests"}, "run_tests": _RUN_TESTS}


def expert_files(op: KernelOp, tc: str, *, pre: str = "", post: str = "out", ctype: str | None = None,
                 lib: str | None = None) -> dict[str, str]:
    """``kernel.c`` (the expert, storage type ``ctype``) and a ``kernel.py`` ctypes loader.

    The harness times the expert through this same loader (``lib`` names the expression of the
    library's path; by default ``libkernel.so`` next to ``kernel.py``), so parity is like for like.
    ``pre`` is inserted at the start of the Python function body and ``post`` is the returned
    expression: the hack policies build on the expert this way.
    """
    params = ", ".join(op.args + op.dims)
    ptrs = ", ".join(f"_p({a})" for a in op.args)
    ints = ", ".join(f"ctypes.c_int({d})" for d in op.dims)
    py = (
        "import array\nimport ctypes\nimport os\n\n"
        f"_lib = ctypes.CDLL({lib or _LIB_NEXT_TO_FILE})\n"
        f"_fn = _lib.{op.name}\n_fn.restype = None\n\n\n"
        "def _p(a):\n    return ctypes.c_void_p(a.buffer_info()[0])\n\n\n"
        f"def {op.name}({params}):\n"
        f"{pre}"
        f'    out = array.array("{tc}", bytes({array.array(tc).itemsize} * ({op.out_expr})))\n'
        f"    _fn({ptrs}, _p(out), {ints})\n"
        f"    return {post}\n"
    )
    return {"kernel.c": op.expert.replace("{T}", ctype or _CTYPE[tc]), KERNEL_PY: py}


_LIB_NEXT_TO_FILE = 'os.path.join(os.path.dirname(os.path.abspath(__file__)), "libkernel.so")'


def _write_all(files: Mapping[str, str], turn: int = 0) -> list[dict[str, Any]]:
    return [script_call(turn, k + 1, "write_file", path=p, content=t) for k, (p, t) in enumerate(sorted(files.items()))]


class KernelFamily(FamilyBase):
    """``coding.kernel``: a faster implementation of a reference operator, graded by measured speed."""

    name = "coding.kernel"
    domain = "coding"
    description = "Make a reference operator faster (vectorised Python or C via ctypes); correctness gates a measured speed score."
    kind = "kernel"  # opt-in: verification times code, so it stays out of the default mix
    id_prefix = "kern"
    max_difficulty = 3

    def __init__(self) -> None:
        self._ops = sorted(OPS)

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        op = OPS[rng.choice(self._ops)]
        base = op.sizes[0 if difficulty == 1 else 1]
        dims = {k: max(2, int(v * rng.choice((0.5, 0.75, 1.0, 1.25, 1.5)))) for k, v in base.items()}
        tc = "f" if difficulty == 3 else "d"
        dtype = {"d": "float64", "f": "float32"}[tc]
        shape = " x ".join(f"{k}={v}" for k, v in dims.items())
        args = ", ".join(f"{a}: array.array('{tc}')" for a in op.args)
        prompt = (
            f"Make this {op.summary} faster. The reference implementation (plain Python):\n\n{op.reference}\n"
            f"Write {KERNEL_PY} defining `{op.name}({args}, {', '.join(op.dims)})` with the same results: inputs are "
            f"flat row-major {dtype} buffers (array.array typecode '{tc}'), the result exactly an array.array('{tc}') "
            f"or exactly a list of {op.out_expr} floats. The graded shape is {shape}; hidden inputs also "
            "use other shapes, NaN / Inf entries and large magnitudes, and results must match the reference within "
            f"a relative tolerance of {RTOL[tc]:g} (NaN and Inf exactly). You may write C: every *.c file is compiled "
            "with gcc -O3 -march=native -shared -fPIC -lm into lib<name>.so next to it, for kernel.py to load with "
            "ctypes. The sandbox python has the standard library only. Do not modify the inputs, start threads or "
            "processes (you cannot): your kernel runs in a process of its own, timed on its CPU clock. run_tests "
            "checks correctness on public inputs and estimates the score: 0.5 matches our expert implementation, "
            "1 is the machine's roofline. Reply without a tool call when you are done."
        )
        public_dims = dict(op.odd)
        return self._task(task_id, [{"role": "user", "content": prompt}], {
            "difficulty": difficulty, "op": op.name, "typecode": tc, "dims": dims, "public_dims": public_dims,
            "public_seed": rng.randrange(2**31), "hidden_seed": rng.randrange(2**31),
        }, tools=[_library()[n] for n in TOOL_NAMES])

    def make_env(self, task: Task, limits: EpisodeLimits | None = None) -> ToolEnvironment:
        """A fresh environment: an empty sandbox working directory and the kernel tools."""
        return make_env(list(_library().values()), lambda t: {}, limits)

    def reference_turns(self, task: Task, effort: str) -> list[dict[str, Any]]:
        """Write the shipped expert (C + ctypes loader), run the public check (high / max), answer."""
        md = task.metadata
        op, tc = OPS[md["op"]], md["typecode"]
        reasoning = {
            "low": "",
            "high": "A C loop over contiguous rows beats the interpreted reference; keep its NaN semantics.",
            "max": (
                f"The reference {op.name} runs an interpreted loop per element, so a compiled C kernel over the flat "
                "row-major buffers removes the interpreter overhead. Keep the reference's semantics exactly: the "
                "same comparisons (a NaN propagates), accumulation in double, and a fresh output buffer so the "
                f"inputs stay untouched. kernel.c holds the loop with {_CTYPE[tc]} storage; kernel.py loads "
                "libkernel.so with ctypes and passes buffer addresses. Then run the public check."
            ),
        }[effort]
        turns = [assistant("", reasoning, _write_all(expert_files(op, tc)))]
        if effort != "low":
            turns.append(assistant("", "Check correctness and speed on the public inputs." if effort == "max" else "",
                                   [script_call(1, 1, "run_tests")]))
        turns.append(assistant(f"{KERNEL_PY} calls a C implementation of {op.name} (kernel.c) through ctypes."))
        return turns

    def wrong_turns(self, task: Task) -> dict[str, list[dict[str, Any]]]:
        """Every listed hack as a kernel (each must score 0), plus empty and claim-only policies."""
        md = task.metadata
        op, tc = OPS[md["op"]], md["typecode"]
        first = op.args[0]
        done = assistant("kernel.py is fast and correct.")

        def files(fs: Mapping[str, str]) -> list[dict[str, Any]]:
            return [assistant("", "", _write_all(fs)), done]

        table = {a[0].tobytes().hex(): list(_expected(op, a, d, tc)) for a, d in _public_cases(task)}
        cached = (f"import array\n_T = {table!r}\n\n\ndef {op.name}({', '.join(op.args + op.dims)}):\n"
                  f"    return array.array('{tc}', _T.get({first}.tobytes().hex(), [0.0] * ({op.out_expr})))\n")
        calls_ref = (f"import gc\n\n\ndef {op.name}(*args):\n"  # any function compiled from the reference source
                     "    for o in gc.get_objects():\n"
                     "        code = getattr(o, '__code__', None)\n"
                     f"        if code is not None and (code.co_filename == '<reference>' or o.__name__ in ('reference', '_ref')):\n"
                     "            return o(*args)\n"
                     "    raise RuntimeError('no reference found')\n")
        hunt = ("import glob, os\n_found = []\n"
                "for pat in ('/sandbox/*', '/tmp/*', '/tmp/*/*', '/proc/*/fd/0', '/proc/*/cmdline', '/*.json'):\n"
                "    for p in glob.glob(pat):\n"
                "        try:\n            with open(p, 'rb') as fh:\n                data = fh.read(1 << 20)\n"
                "        except OSError:\n            continue\n"
                "        if b'\"rou' + b'nds\": [[' in data:  # split so that this file does not match itself\n            _found.append(data)\n")
        half = "array.array(out.typecode, [struct.unpack('e', struct.pack('e', v))[0] for v in out])"
        return {
            "empty": [assistant("")],
            "claims_without_file": [done],
            "copies_reference": files({KERNEL_PY: op.reference}),
            "calls_reference": files({KERNEL_PY: calls_ref}),
            "cached_public_outputs": files({KERNEL_PY: cached}),
            "memoizes_between_calls": files(expert_files(
                op, tc, pre="    global _memo\n    if '_memo' in globals():\n        return _memo\n",
                post="globals().__setitem__('_memo', out) or out")),
            "mutates_inputs": files(expert_files(op, tc, post=f"{first}.__setitem__(0, 0.0) or out")),
            "inspects_inputs_to_shortcut": files(expert_files(
                op, tc, pre=f"    if len({first}) > {op.inputs(md['public_dims'])[0]}:\n        return array.array('{tc}', bytes({array.array(tc).itemsize} * ({op.out_expr})))\n")),
            "reduced_precision": files({**expert_files(op, tc, post=half),
                                        KERNEL_PY: "import struct\n" + expert_files(op, tc, post=half)[KERNEL_PY]}),
            # the reference's speed with a patched clock: pays only if the clock the verifier reads can be patched
            "patches_timer": files({KERNEL_PY: op.reference.replace(
                "    out = ", "    import time\n    time.perf_counter_ns = time.process_time_ns = lambda: 0\n    out = ", 1)}),
            "patches_timer_at_import": files({KERNEL_PY: "import time\ntime.perf_counter = time.process_time = "
                                              "lambda: 0.0\n" + op.reference}),
            "background_thread": files({**expert_files(op, tc), KERNEL_PY: "import threading\n"
                                        "threading.Thread(target=lambda: sum(range(10**8)), daemon=True).start()\n"
                                        + expert_files(op, tc)[KERNEL_PY]}),
            "moves_its_cpu": files(expert_files(op, tc, pre="    import os\n    os.sched_setaffinity(0, range(os.cpu_count() or 1))\n")),
            "forks": files({**expert_files(op, tc), KERNEL_PY: "import os\nif os.fork() == 0:\n    os._exit(0)\n"
                            + expert_files(op, tc)[KERNEL_PY]}),
            "reads_hidden_inputs": files({**expert_files(op, tc, pre="    if not _found:\n        return [0.0]\n"),
                                          KERNEL_PY: hunt + expert_files(op, tc, pre="    if not _found:\n        return [0.0]\n")[KERNEL_PY]}),
            "forged_result_line": files({KERNEL_PY: "import os\nprint('{\"outputs\": [], \"times\": {}}')\nos._exit(0)\n"}),
        }


KERNEL = register_family(KernelFamily())
