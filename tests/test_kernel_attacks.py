"""coding.kernel's harness against adversarial submissions (issue 30 §1).

`tests/kernel_attacks.py` holds the submissions; here the documented command runs them (every attack 0, the
honest slow kernel 0, the honest fast one above 0) and the properties the design rests on are checked one by
one on `KernelChild`: alone in its PID namespace, no threads / processes, sealed shared memory, stopped (its
clock still) between calls, exact result types, and work done while materialising a result counted. No
assertion compares two timings: the CPU-time checks are lower bounds the child itself has measured on its
own clock (the parent's window contains the child's).
"""

from __future__ import annotations

import array
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3post.envs.kernel_child import ChildError, KernelChild
from k3post.envs.sandbox import Sandbox

ROOT = Path(__file__).resolve().parents[1]
CAP = 1 << 16


def test_documented_attack_table_every_attack_scores_zero():
    """`python tests/kernel_attacks.py softmax 1` (the command in docs/decisions.md)."""
    proc = subprocess.run([sys.executable, "tests/kernel_attacks.py", "softmax", "1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines()[2:]:
        name, reward, verdict = (c.strip() for c in line.strip("|").split("|"))
        rows[name] = (float(reward), verdict)
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import kernel_attacks
    finally:
        sys.path.remove(str(ROOT / "tests"))
    from k3post.envs.families.kernel.ops import OPS

    assert set(rows) == set(kernel_attacks.attacks(OPS["softmax"], "d"))
    assert rows["honest_fast"][0] > 0, rows["honest_fast"]
    bad = {n: r for n, r in rows.items() if n != "honest_fast" and r[0] != 0.0}
    assert not bad, bad
    for name in ("lazy_iterable", "array_subclass", "list_subclass"):
        assert rows[name][1].startswith("output: the result must be"), rows[name]
    assert rows["mutates_inputs"][1].startswith("mutated")
    usage = subprocess.run([sys.executable, "tests/kernel_attacks.py", "nope"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert usage.returncode == 2 and "usage" in usage.stderr


_PROBE = r'''
import array, json, os, sys, threading
info = {"pid": os.getpid(), "ppid": os.getppid(), "procs": sorted(p for p in os.listdir("/proc") if p.isdigit())}
try:
    threading.Thread(target=lambda: None).start()
    info["thread"] = "started"
except RuntimeError as exc:
    info["thread"] = str(exc)
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    info["fork"] = "forked"
except OSError as exc:
    info["fork"] = exc.strerror
try:
    os.ftruncate(int(sys.argv[-1]), 0)
    info["shrink"] = "shrunk"
except OSError as exc:
    info["shrink"] = exc.strerror
for target in ("/proc/0/mem", "/proc/2/mem"):
    try:
        open(target, "rb").close()
        info[target] = "opened"
    except OSError as exc:
        info[target] = exc.strerror
with open("probe.json", "w") as fh:
    json.dump(info, fh)


def f(x, n):
    return list(x)
'''


def test_child_is_alone_without_threads_processes_or_a_resizable_buffer():
    with Sandbox() as sb:
        sb.write_file("probe.py", _PROBE)
        child = KernelChild(sb, "d", "f", "probe", capacity=CAP)
        try:
            info = json.loads(sb.read_file("probe.json"))
            outs, echoes, ns = child.call([[array.array("d", [1.0, 2.0]).tobytes()]], [2])
        finally:
            child.close()
    assert info["pid"] == 1 and info["ppid"] == 0 and info["procs"] == ["1"], info
    assert info["thread"] != "started" and info["fork"] != "forked", info
    assert info["shrink"] != "shrunk", info  # the memfd is sealed: the parent's mapping cannot fault
    assert all(info[t] != "opened" for t in ("/proc/0/mem", "/proc/2/mem")), info
    assert outs == [array.array("d", [1.0, 2.0]).tobytes()] and echoes == outs and ns > 0


_BURN = r'''
import array, time

BURN_NS = 30_000_000


class Cell:
    def __init__(self, v):
        self.v = v

    def __float__(self):  # the conversion (materialising the result) does the work
        t0 = time.process_time_ns()
        while time.process_time_ns() - t0 < BURN_NS:
            pass
        return self.v


def lazy(x, n):
    return [Cell(v) for v in x[:1]] + list(x[1:])


class Sub(list):
    pass


class ASub(array.array):
    pass


def sub(x, n):
    return Sub(x)


def asub(x, n):
    return ASub("d", x)


def gen(x, n):
    return (v for v in x)


def short(x, n):
    return array.array("f", x)
'''


def test_materialising_the_result_is_timed_and_only_exact_types_pass():
    with Sandbox() as sb:
        sb.write_file("burn.py", _BURN)
        lazy = KernelChild(sb, "d", "lazy", "burn", capacity=CAP)
        try:
            outs, _, ns = lazy.call([[array.array("d", [3.0, 4.0]).tobytes()]], [2])
            # the child burnt BURN_NS on its own CPU clock inside the timed window: a lower bound, not a race
            assert ns >= 30_000_000 and outs == [array.array("d", [3.0, 4.0]).tobytes()]
            before = lazy.cpu_ns()
            time.sleep(0.05)
            assert lazy.cpu_ns() == before  # stopped between calls: its clock does not move
            assert lazy._state() in ("T", "t")
        finally:
            lazy.close()
        for func, what in (("sub", "Sub"), ("asub", "ASub"), ("gen", "generator"), ("short", "array.array('f')")):
            child = KernelChild(sb, "d", func, "burn", capacity=CAP)
            try:
                with pytest.raises(ChildError) as err:
                    child.call([[array.array("d", [1.0]).tobytes()]], [1])
            finally:
                child.close()
            assert err.value.kind == "output" and what in err.value.why, (func, err.value)


def test_import_errors_and_deaths_are_reported_by_kind():
    with Sandbox() as sb:
        sb.write_file("broken.py", "raise ValueError('no')\n")
        sb.write_file("dies.py", "import os\n\n\ndef f(x, n):\n    os._exit(3)\n")
        with pytest.raises(ChildError) as err:
            KernelChild(sb, "d", "f", "broken", capacity=CAP)
        assert err.value.kind == "import" and "ValueError: no" in err.value.why
        child = KernelChild(sb, "d", "f", "dies", capacity=CAP)
        try:
            with pytest.raises(ChildError) as err:
                child.call([[array.array("d", [1.0]).tobytes()]], [1])
        finally:
            child.close()
        assert err.value.kind == "died"


def test_a_failing_trusted_child_is_the_verifiers_error_not_the_agents_zero(monkeypatch):
    from k3post.envs.families.kernel import family as K
    from k3post.envs.families.kernel.ops import OPS

    task = next(t for t in K.KERNEL.generate(40, seed=0, difficulty=1) if t.metadata["op"] == "row_sumsq")
    orig = K._trusted_files
    monkeypatch.setattr(K, "_trusted_files", lambda op, tc: {
        **orig(op, tc), "reference.py": f"def {op.name}(*a):\n    raise SystemError('broken reference')\n"})
    with Sandbox() as sb:
        for path, text in K.expert_files(OPS["row_sumsq"], "d").items():
            sb.write_file(path, text)
        with pytest.raises(RuntimeError, match="trusted ref child failed"):
            K.measure(task, sb)


def test_spawn_on_the_weak_backend_is_the_command_itself_and_flagged():
    with pytest.warns(RuntimeWarning, match="WEAK"):
        sb = Sandbox(backend="rlimit")
    with sb:
        sb.write_file("echo.py", "def f(x, n):\n    return list(x)\n")
        child = KernelChild(sb, "d", "f", "echo", capacity=CAP)
        try:
            assert child.proc.weak_isolation and child.pid == child.proc.popen.pid
            outs, _, _ = child.call([[array.array("d", [5.0]).tobytes()]], [1])
            assert outs == [array.array("d", [5.0]).tobytes()]
        finally:
            child.close()
