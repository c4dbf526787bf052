"""Hidden verification runs the program under test as the task defines it, isolated (issue 30 §2).

Each attack below scored reward 1 before the fix (checked on the old code) with the deliverable wrong: files
the agent may not change (a ``json.py`` next to the program, an ``app/router/`` package, a user-site
``usercustomize.py`` or ``.pth``) changed what ran. Now the hidden tree restores everything outside what the
agent may change, Python runs isolated (``-I``, source modules only, the tree last on ``sys.path``), HOME is
outside the tree, the tree is read-only, and each scenario runs in its own sandbox launched from the host, so
no process the program can see holds the other scenarios' inputs. The honest solution still scores 1.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from k3post.envs import FinalState, Task
from k3post.envs.families.aet.core import AETState, evaluate, verification_tree, verify_aet
from k3post.envs.families.aet.family import CLI, CONFIG, ROUTER_SOURCE
from k3post.envs.sandbox import Sandbox, probe_backend

# Serve the right config whatever config/ holds: `open` and `os.path.exists` answer from this table.
_PATCH = '''
import builtins, io, os
SOL = __SOL__
_open, _exists = builtins.open, os.path.exists
def _key(f):
    return os.fspath(f).replace(os.sep, "/") if isinstance(f, (str, os.PathLike)) else None
def open(f, *a, **k):
    if _key(f) in SOL:
        return io.StringIO(SOL[_key(f)])
    return _open(f, *a, **k)
builtins.open = open
os.path.exists = lambda p: _key(p) in SOL or _exists(p)
'''

# A json.py next to the program: load the real json, then patch.
_JSON_SHADOW = '''
import os, sys
sys.modules.pop(__name__, None)
_saved = sys.path[:]
sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]
import json as _real
sys.path[:] = _saved
sys.modules[__name__] = _real
'''

_SITE_VERSIONS = [f"python3.{m}" for m in range(8, 15)]


def _config_task(seed: int = 5) -> Task:
    return CONFIG.generate(1, seed=seed, difficulty=3)[0]


def _patch_source(task: Task) -> str:
    return _PATCH.replace("__SOL__", repr(dict(task.metadata["solution"])))


def _broken(task: Task) -> dict[str, str]:
    """The task's initial files: config/ as broken as it starts."""
    return dict(task.metadata["files"])


def _attack_json_shadow(task: Task) -> dict[str, str]:
    return {**_broken(task), "json.py": _JSON_SHADOW + _patch_source(task)}


def _attack_router_package(task: Task) -> dict[str, str]:
    sol = task.metadata["solution"]
    main = ROUTER_SOURCE.replace('os.path.join("config", ', 'os.path.join("app", "router", "good", ')
    return {**_broken(task), "app/router/__init__.py": "", "app/router/__main__.py": main,
            **{"app/router/good/" + p.split("/", 1)[1]: t for p, t in sol.items()}}


def _attack_usercustomize(task: Task) -> dict[str, str]:
    return {**_broken(task), **{f".local/lib/{v}/site-packages/usercustomize.py": _patch_source(task) for v in _SITE_VERSIONS}}


def _attack_pth(task: Task) -> dict[str, str]:
    files = _broken(task)
    for v in _SITE_VERSIONS:
        files[f".local/lib/{v}/site-packages/k3hack.pth"] = "import k3hack\n"
        files[f".local/lib/{v}/site-packages/k3hack.py"] = _patch_source(task)
    return files


ATTACKS = {"json_shadow": _attack_json_shadow, "router_package": _attack_router_package,
           "usercustomize": _attack_usercustomize, "pth": _attack_pth}


def _verify(task: Task, files: dict[str, str]) -> Any:
    state = AETState(files)
    try:
        return verify_aet(task, FinalState(state, "done"))
    finally:
        state.close()


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_config_attacks_score_zero(name: str) -> None:
    t = _config_task()
    v = _verify(t, ATTACKS[name](t))
    assert v.reward == 0.0, (name, v)
    assert v.components["hidden_pass_rate"] < 1.0


def test_config_honest_solution_scores_one() -> None:
    t = _config_task()
    assert _verify(t, {**_broken(t), **t.metadata["solution"]}).reward == 1.0


def test_config_verification_tree_restores_all_but_config() -> None:
    t = _config_task()
    files = {**_attack_router_package(t), **t.metadata["solution"], "app/router.py": "print('mine')\n", "json.py": "x"}
    tree = verification_tree(t.metadata, files)
    assert tree == {**t.metadata["files"], **t.metadata["solution"]}


# --------------------------------------------------------------------------- the other scenario inputs stay out of reach

_PEEK = r'''
import os, re, sys
OWN = sys.stdin.read()
TARGETS = [t.encode() for t in __TARGETS__ if t != OWN]  # its own input it may read
me, tried, read, hits = os.getpid(), 0, 0, []
for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]:
    tried += 1
    try:
        with open(f"/proc/{pid}/maps") as fh:
            maps = fh.read().splitlines()
        with open(f"/proc/{pid}/mem", "rb", 0) as mem:
            for line in maps:
                m = re.match(r"([0-9a-f]+)-([0-9a-f]+) r", line)
                if not m:
                    continue
                lo, hi = int(m.group(1), 16), int(m.group(2), 16)
                try:
                    mem.seek(lo)
                    data = mem.read(min(hi - lo, 64 << 20))
                except (OSError, ValueError, OverflowError):
                    continue
                read += 1
                hits += [i for i, t in enumerate(TARGETS) if t in data]
    except OSError:
        pass
sys.stdout.write(f"PEEK tried={tried} regions={read} hits={sorted(set(hits))}\n")
'''


def test_program_under_test_cannot_read_other_processes_memory() -> None:
    """A tally.py that scans every visible process's memory for the other scenarios' inputs finds nothing.

    Before the fix the in-sandbox driver (the program's parent, same uid, dumpable) held every scenario's
    stdin and the result nonce, and this probe found them.
    """
    t = CLI.generate(1, seed=23, difficulty=3)[0]
    hidden = t.metadata["hidden"]
    targets = sorted({sc["stdin"] for sc in hidden if len(sc.get("stdin", "")) >= 12})
    assert len(targets) >= 3
    files = {**t.metadata["files"], "tally.py": _PEEK.replace("__TARGETS__", repr(targets))}
    reasons, _weak = evaluate(t.metadata, files, hidden)
    peeks = [r for r in reasons if r is not None and "PEEK tried=" in r]
    assert len(peeks) >= 3, reasons  # a scenario whose exit code differs shows no stdout
    assert all("hits=[]" in r for r in peeks), peeks


def test_cli_honest_solution_scores_one_and_user_site_is_ignored() -> None:
    t = CLI.generate(1, seed=23, difficulty=3)[0]
    sol = t.metadata["solution"]["tally.py"]
    assert _verify(t, {**t.metadata["files"], "tally.py": sol}).reward == 1.0
    # A user-site hook that would make a stub pass (it runs the reference before the stub) is not loaded.
    hook = (f"import os, sys\nif sys.argv and sys.argv[0].endswith('tally.py'):\n    ns = {{'__name__': 'ref'}}\n"
            f"    exec({sol!r}, ns)\n    code, out = ns['run'](sys.argv[1:], sys.stdin.read())\n"
            "    sys.stdout.write(out)\n    sys.stdout.flush()\n    os._exit(code)\n")
    files = {**t.metadata["files"], **{f".local/lib/{v}/site-packages/usercustomize.py": hook for v in _SITE_VERSIONS}}
    assert _verify(t, files).reward == 0.0


# --------------------------------------------------------------------------- Sandbox.run_hidden


_PLANT_PYC = ("import importlib.util, py_compile\npy_compile.compile('helper.py', cfile=importlib.util.cache_from_source("
              "'helper.py'), doraise=True, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)\n")


@pytest.mark.parametrize("backend", ["bwrap", "unshare"])
def test_run_hidden_is_isolated_and_read_only(backend: str) -> None:
    if not probe_backend(backend):
        pytest.skip(f"the {backend} backend does not work here")
    probe = r'''
import os, sys
print(sys.flags.isolated, sys.flags.no_user_site, os.environ["HOME"])
print(sys.path[-1] == os.getcwd(), "" not in sys.path[:-1] and os.getcwd() not in sys.path[:-1])
import json
print(json.__file__.startswith(os.getcwd()))
try:
    open("w.txt", "w").write("x")
    print("wrote")
except OSError:
    print("read-only")
import helper
print(helper.X, sys.argv[1:])
'''
    with Sandbox(backend=backend) as sb:
        sb.write_file("prog.py", probe)
        sb.write_file("json.py", "raise SystemExit('shadowed')\n")
        # A planted .pyc that Python loads without checking the source it stands for: plain Python takes it.
        sb.write_file("helper.py", "X = 99\n")
        plant = sb.run(["python", "-c", _PLANT_PYC])
        assert plant.ok, plant.stderr
        sb.write_file("helper.py", "X = 7\n")
        control = sb.run(["python", "-B", "-c", "import helper; print(helper.X)"])
        assert control.stdout == "99\n", control
        res = sb.run_hidden(["prog.py", "a", "b"])
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        assert lines[0] == "1 1 /nonexistent" and lines[1] == "True True" and lines[2] == "False"
        assert lines[3] == "read-only"
        assert lines[4] == "7 ['a', 'b']"
        sb.write_file("pkg/__init__.py", "")
        sb.write_file("pkg/mod.py", "import sys\nprint('mod', sys.argv[1:])\nsys.exit(3)\n")
        res = sb.run_hidden(["-m", "pkg.mod", "x"])
        assert (res.returncode, res.stdout) == (3, "mod ['x']\n")
        assert sb.read_file("prog.py", max_bytes=6) == "\nimpor"
