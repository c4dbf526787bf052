"""Problem material for the coding families: function templates, tiny buggy repos, sandbox runners.

Everything here is pure data and pure functions of a `random.Random`; running model code happens
in `k3post.envs.families.coding.family` through the sandbox. Two kinds of material:

* **Function templates** (`FN_TEMPLATES`) for ``coding.write_function``: each draws parameters
  from the rng and returns a `FnProblem` (signature, statement, the reference implementation's
  source, an approach sentence for the reference solver's reasoning, an input generator and
  edge-case inputs). Expected outputs are computed by executing the reference source (our own
  trusted code) in-process at generation time.
* **Repo templates** (`REPO_TEMPLATES`) for ``coding.bugfix``: 2 source modules plus a test
  module, each with candidate bug sites (a unique fragment of correct code, its buggy
  replacement, the kind of bug and why it is wrong) and generators of test calls.

Values crossing the sandbox boundary are compared in a strictly typed, tagged JSON form
(`encode_value`): ``True`` is not ``1``, a tuple is not a list, a subclass of ``int`` with a
forged ``__eq__`` is not an ``int``. The same encoder runs inside the sandbox (`CALL_RUNNER`)
and on the host, and the comparison with expected values happens on the host, so nothing the
sandboxed code prints or patches can make a wrong answer pass.
"""

from __future__ import annotations

import builtins
import copy
import random
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ENCODER_SOURCE",
    "CALL_RUNNER",
    "TEST_RUNNER",
    "FnProblem",
    "FN_TEMPLATES",
    "BugSite",
    "RepoTemplate",
    "REPO_TEMPLATES",
    "encode_value",
    "decode_value",
    "load_modules",
    "call_in_modules",
]

# --------------------------------------------------------------------------- typed encoding

ENCODER_SOURCE = '''
def encode_value(v, _depth=0):
    """Strict tagged JSON form of a value: exact types only (no subclasses), bounded depth."""
    if _depth > 32:
        return ["error", "nesting deeper than 32"]
    t = type(v)
    if v is None:
        return ["none", None]
    if t is bool:
        return ["bool", v]
    if t is int:
        return ["int", v]
    if t is str:
        return ["str", v]
    if t is float:
        return ["float", repr(v)]
    if t is list:
        return ["list", [encode_value(x, _depth + 1) for x in v]]
    if t is tuple:
        return ["tuple", [encode_value(x, _depth + 1) for x in v]]
    if t is dict:
        items = [[encode_value(k, _depth + 1), encode_value(x, _depth + 1)] for k, x in v.items()]
        return ["dict", sorted(items, key=repr)]
    return ["other", t.__module__ + "." + t.__qualname__]
'''

_enc_ns: dict[str, Any] = {}
exec(compile(ENCODER_SOURCE, "<k3post-encoder>", "exec"), _enc_ns)  # noqa: S102 - our own constant source
encode_value: Callable[[Any], Any] = _enc_ns["encode_value"]
"""Host copy of the sandbox encoder: ``encode_value(3) == ["int", 3]``."""


def decode_value(enc: Any) -> Any:
    """Inverse of `encode_value` for display (``["other", name]`` becomes ``<name object>``)."""
    if not isinstance(enc, list) or len(enc) != 2:
        return f"<malformed {enc!r}>"
    tag, v = enc
    if tag == "none":
        return None
    if tag in ("bool", "int", "str"):
        return v
    if tag == "float":
        return float(v)
    if tag == "list":
        return [decode_value(x) for x in v]
    if tag == "tuple":
        return tuple(decode_value(x) for x in v)
    if tag == "dict":
        return {repr(decode_value(k)): decode_value(x) for k, x in v}
    return f"<{v} object>"


# --------------------------------------------------------------------------- sandbox runners

CALL_RUNNER = (
    '''
import copy, importlib, json, os, sys
'''
    + ENCODER_SOURCE
    + '''
def _main(cfg):
    # Keep our result channel private: code under test writes to stderr, whatever it prints.
    result_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    sys.path.insert(0, os.getcwd())
    out = {"results": [], "error": None}
    mods = {}
    for case in cfg["cases"]:
        name = case["module"]
        try:
            if name not in mods:
                mods[name] = importlib.import_module(name)
            fn = getattr(mods[name], case["func"])
            value = fn(*copy.deepcopy(case["args"]))
            out["results"].append({"ok": True, "value": encode_value(value)})
        except BaseException as e:  # SystemExit and KeyboardInterrupt included: a failed case
            out["results"].append({"ok": False, "error": type(e).__name__ + ": " + str(e)[:300]})
    os.write(result_fd, ("\\n" + cfg["nonce"] + " " + json.dumps(out) + "\\n").encode())

_main(json.loads(__CFG__))
'''
)
"""Imports modules from the working directory, calls functions on arguments, prints typed results.

Fed to ``python -I -`` on stdin with ``__CFG__`` replaced by a JSON string literal of
``{"nonce", "cases": [{"module", "func", "args"}]}``; the result is the line starting with the
nonce: ``{"results": [{"ok", "value" | "error"}], "error"}``. Expected values never enter the
sandbox: the host compares.
"""

TEST_RUNNER = '''
import importlib, os, sys, traceback
sys.path.insert(0, os.getcwd())
passed = failed = 0
for fname in sorted(os.listdir(".")):
    if not (fname.startswith("test_") and fname.endswith(".py")):
        continue
    try:
        mod = importlib.import_module(fname[:-3])
    except BaseException as e:
        failed += 1
        print(f"ERROR {fname}: cannot import: {type(e).__name__}: {e}")
        continue
    for name in sorted(n for n in vars(mod) if n.startswith("test_") and callable(getattr(mod, n))):
        try:
            getattr(mod, name)()
            passed += 1
            print(f"PASS {name}")
        except BaseException as e:
            failed += 1
            tb = traceback.extract_tb(e.__traceback__)
            frame = tb[-1] if tb else None
            where = f" ({os.path.basename(frame.filename)}:{frame.lineno}: {frame.line})" if frame else ""
            msg = f": {e}" if str(e) else ""
            print(f"FAIL {name}{where} {type(e).__name__}{msg}")
print(f"{passed} passed, {failed} failed")
'''
"""The visible test runner of ``coding.bugfix``'s ``run_tests`` tool (fed to ``python -I -``).

It imports every ``test_*.py`` module of the working directory and calls its ``test_*``
functions (no pytest, so no conftest.py or plugin can interfere), printing ``PASS`` / ``FAIL``
lines and ``N passed, M failed``.
"""


# --------------------------------------------------------------------------- in-process loading (trusted code)


def load_modules(files: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Execute the ``.py`` sources of ``files`` (our own trusted template code) as modules.

    Imports between them resolve to each other without touching ``sys.modules``. Returns
    module name -> namespace. Only for generation-time evaluation of reference code.
    """
    sources = {p[:-3]: src for p, src in files.items() if p.endswith(".py") and "/" not in p}
    loaded: dict[str, dict[str, Any]] = {}
    real_import = builtins.__import__

    class _Mod:
        def __init__(self, ns: dict[str, Any]) -> None:
            self.__dict__.update(ns)

    def load(name: str) -> dict[str, Any]:
        if name not in loaded:
            ns: dict[str, Any] = {"__name__": name, "__builtins__": bdict}
            loaded[name] = ns
            exec(compile(sources[name], f"<{name}.py>", "exec"), ns)  # noqa: S102 - trusted template code
        return loaded[name]

    def imp(name: str, globals_: Any = None, locals_: Any = None, fromlist: Sequence[str] = (), level: int = 0) -> Any:
        if level == 0 and name in sources:
            return _Mod(load(name))
        return real_import(name, globals_, locals_, fromlist, level)

    bdict = dict(builtins.__dict__)
    bdict["__import__"] = imp
    for name in sources:
        load(name)
    return loaded


def call_in_modules(mods: Mapping[str, Mapping[str, Any]], module: str, func: str, args: Sequence[Any]) -> Any:
    """``module.func(*args)`` on namespaces from `load_modules`; an exception is returned as a tag."""
    try:
        return encode_value(mods[module][func](*copy.deepcopy(list(args))))
    except Exception as e:  # noqa: BLE001 - a buggy variant may raise; that is a result
        return ["raised", type(e).__name__]


# --------------------------------------------------------------------------- write-a-function templates


@dataclass(frozen=True)
class FnProblem:
    """One drawn function-writing problem.

    Attributes:
        func: function name.
        signature: ``def f(xs: list[int]) -> int``.
        statement: what the function returns (one or two sentences).
        solution: source of a reference implementation (complete, a few lines).
        approach: one sentence on how the reference implementation works.
        gen: draws one argument list from an rng.
        edge: argument lists always included among the hidden tests.
        key: template key (for dedup and analysis).
        params: the drawn template parameters.
    """

    func: str
    signature: str
    statement: str
    solution: str
    approach: str
    gen: Callable[[random.Random], list[Any]]
    edge: tuple[tuple[Any, ...], ...] = ()
    key: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)


def _ints(rng: random.Random, n_lo: int = 0, n_hi: int = 8, lo: int = -20, hi: int = 20) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(n_lo, n_hi))]


def _word(rng: random.Random, lo: int = 1, hi: int = 7, alphabet: str = string.ascii_lowercase) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _t_sum_divisible(rng: random.Random) -> FnProblem:
    k = rng.randint(2, 5)
    return FnProblem(
        "sum_divisible",
        "def sum_divisible(xs: list[int]) -> int",
        f"It returns the sum of the elements of xs that are divisible by {k} (0 if there are none).",
        f"def sum_divisible(xs: list[int]) -> int:\n    return sum(x for x in xs if x % {k} == 0)\n",
        f"Sum the elements x with x % {k} == 0 using a generator expression.",
        lambda r: [_ints(r)],
        (([],), ([k, -k, 1],)),
        "sum_divisible",
        {"k": k},
    )


def _t_count_above(rng: random.Random) -> FnProblem:
    t = rng.randint(-5, 10)
    return FnProblem(
        "count_above",
        "def count_above(xs: list[int]) -> int",
        f"It returns how many elements of xs are strictly greater than {t}.",
        f"def count_above(xs: list[int]) -> int:\n    return sum(1 for x in xs if x > {t})\n",
        f"Count the elements with x > {t}; equal elements do not count.",
        lambda r: [_ints(r)],
        (([],), ([t, t + 1, t - 1],)),
        "count_above",
        {"t": t},
    )


def _t_affine(rng: random.Random) -> FnProblem:
    a, b = rng.randint(2, 5), rng.choice([-3, -2, -1, 1, 2, 3])
    sign = "+" if b > 0 else "-"
    return FnProblem(
        "affine",
        "def affine(xs: list[int]) -> list[int]",
        f"It returns a new list in which each element x of xs becomes {a} * x {sign} {abs(b)}.",
        f"def affine(xs: list[int]) -> list[int]:\n    return [{a} * x {sign} {abs(b)} for x in xs]\n",
        f"Map every x to {a} * x {sign} {abs(b)} with a list comprehension, keeping the order.",
        lambda r: [_ints(r)],
        (([],), ([0],)),
        "affine",
        {"a": a, "b": b},
    )


def _t_reverse_suffix(rng: random.Random) -> FnProblem:
    suffix = rng.choice(["!", "?", "-x", "_end", "..", "#"])
    return FnProblem(
        "reverse_suffix",
        "def reverse_suffix(s: str) -> str",
        f"It returns s reversed, followed by the suffix {suffix!r}.",
        f"def reverse_suffix(s: str) -> str:\n    return s[::-1] + {suffix!r}\n",
        f"Reverse s with the slice s[::-1] and append {suffix!r}.",
        lambda r: [_word(r, 0, 9)],
        (("",), ("a",)),
        "reverse_suffix",
        {"suffix": suffix},
    )


def _t_poly(rng: random.Random) -> FnProblem:
    a, b, c = rng.randint(1, 4), rng.randint(-5, 5), rng.randint(-9, 9)
    return FnProblem(
        "poly",
        "def poly(n: int) -> int",
        f"It returns {a}*n*n + ({b})*n + ({c}).",
        f"def poly(n: int) -> int:\n    return {a} * n * n + ({b}) * n + ({c})\n",
        f"Evaluate the polynomial {a}*n*n + ({b})*n + ({c}) directly in integers.",
        lambda r: [r.randint(-30, 30)],
        ((0,), (1,), (-1,)),
        "poly",
        {"a": a, "b": b, "c": c},
    )


def _t_count_chars(rng: random.Random) -> FnProblem:
    letters = "".join(sorted(rng.sample(string.ascii_lowercase, 3)))
    return FnProblem(
        "count_chars",
        "def count_chars(s: str) -> int",
        f"It returns the number of characters of s that are one of the letters {letters!r} (case-sensitive).",
        f"def count_chars(s: str) -> int:\n    count = 0\n    for ch in s:\n        if ch in {letters!r}:\n            count += 1\n    return count\n",
        f"Loop over the characters and count those found in {letters!r}; uppercase letters do not match.",
        lambda r: [_word(r, 0, 12, letters + "xyzAB " + letters.upper())],
        (("",), (letters + letters.upper(),)),
        "count_chars",
        {"letters": letters},
    )


def _t_caesar(rng: random.Random) -> FnProblem:
    k = rng.randint(1, 25)
    return FnProblem(
        "caesar",
        "def caesar(s: str) -> str",
        f"It shifts every lowercase letter a-z of s forward by {k} places in the alphabet, wrapping around "
        "from z to a; every other character stays unchanged.",
        "def caesar(s: str) -> str:\n    out = []\n    for ch in s:\n"
        "        if 'a' <= ch <= 'z':\n"
        f"            ch = chr((ord(ch) - ord('a') + {k}) % 26 + ord('a'))\n"
        "        out.append(ch)\n    return ''.join(out)\n",
        f"For each lowercase letter compute (ord(ch) - ord('a') + {k}) % 26 and map back with chr; keep other characters.",
        lambda r: [_word(r, 0, 10, string.ascii_lowercase + "XYZ !")],
        (("",), ("xyz Z!",)),
        "caesar",
        {"k": k},
    )


def _t_running(rng: random.Random) -> FnProblem:
    kind = rng.choice(["sum", "max"])
    if kind == "sum":
        body = "    out, acc = [], 0\n    for x in xs:\n        acc += x\n        out.append(acc)\n    return out\n"
        stmt = "It returns the running sums of xs: element i is xs[0] + ... + xs[i]."
        appr = "Keep an accumulator, add each x and append the accumulator to the output."
    else:
        body = "    out = []\n    for x in xs:\n        out.append(x if not out else max(out[-1], x))\n    return out\n"
        stmt = "It returns the running maximum of xs: element i is max(xs[0], ..., xs[i])."
        appr = "Append max(previous output, x) for each x (just x for the first element)."
    return FnProblem(
        f"running_{kind}",
        f"def running_{kind}(xs: list[int]) -> list[int]",
        stmt,
        f"def running_{kind}(xs: list[int]) -> list[int]:\n" + body,
        appr,
        lambda r: [_ints(r)],
        (([],), ([-3],), ([-5, -2, -9],)),
        "running",
        {"kind": kind},
    )


def _t_digit_sum(rng: random.Random) -> FnProblem:
    k = rng.randint(2, 9)
    return FnProblem(
        "digit_sum_times",
        "def digit_sum_times(n: int) -> int",
        f"For n >= 0 it returns the sum of the decimal digits of n, multiplied by {k}.",
        f"def digit_sum_times(n: int) -> int:\n    return {k} * sum(int(d) for d in str(n))\n",
        f"Sum int(d) over the characters of str(n) and multiply by {k}.",
        lambda r: [r.randint(0, 10 ** r.randint(1, 7))],
        ((0,), (9,), (1000,)),
        "digit_sum",
        {"k": k},
    )


def _t_rle(rng: random.Random) -> FnProblem:
    sep = rng.choice(["", ",", "-", " "])
    return FnProblem(
        "rle",
        "def rle(s: str) -> str",
        "It run-length encodes s: each maximal run of a repeated character c of length k becomes "
        f"str(k) + c, and the pieces are joined with {sep!r}. The empty string gives ''.",
        "def rle(s: str) -> str:\n    parts = []\n    i = 0\n    while i < len(s):\n        j = i\n"
        "        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
        f"        parts.append(str(j - i) + s[i])\n        i = j\n    return {sep!r}.join(parts)\n",
        "Scan runs with two indices i and j, emit str(j - i) + s[i] per run and join the pieces.",
        lambda r: ["".join(r.choice("aab") * r.randint(1, 3) for _ in range(r.randint(0, 5)))],
        (("",), ("a",), ("aaab",)),
        "rle",
        {"sep": sep},
    )


def _t_longest_run(rng: random.Random) -> FnProblem:
    d = rng.choice([0, 1, 2])
    what = "equal" if d == 0 else f"each element {d} larger than the one before it"
    return FnProblem(
        "longest_run",
        "def longest_run(xs: list[int]) -> int",
        f"It returns the length of the longest block of consecutive elements of xs with {what} "
        "(a single element is a block of length 1; 0 for an empty list).",
        "def longest_run(xs: list[int]) -> int:\n    best = cur = 0\n    for i, x in enumerate(xs):\n"
        f"        cur = cur + 1 if i > 0 and x == xs[i - 1] + {d} else 1\n        best = max(best, cur)\n    return best\n",
        f"Walk the list keeping the current block length (extend it when x == previous + {d}, else restart at 1) and the best.",
        lambda r: [[r.randint(0, 4) + (i * d if r.random() < 0.6 else 0) for i in range(r.randint(0, 9))]],
        (([],), ([7],), ([1, 1 + d, 1 + 2 * d],)),
        "longest_run",
        {"d": d},
    )


def _t_balanced(rng: random.Random) -> FnProblem:
    pairs = rng.sample(["()", "[]", "{}", "<>"], 2)
    opens, closes = "".join(p[0] for p in pairs), "".join(p[1] for p in pairs)
    alphabet = opens + closes + "ab"
    return FnProblem(
        "balanced",
        "def balanced(s: str) -> bool",
        f"It returns True iff the brackets {' and '.join(repr(p) for p in pairs)} in s are balanced and properly "
        "nested; all other characters are ignored.",
        "def balanced(s: str) -> bool:\n    stack = []\n    for ch in s:\n"
        f"        if ch in {opens!r}:\n            stack.append(ch)\n"
        f"        elif ch in {closes!r}:\n"
        f"            if not stack or {opens!r}.index(stack.pop()) != {closes!r}.index(ch):\n                return False\n"
        "    return not stack\n",
        "Push opening brackets on a stack; a closing bracket must match the popped opener; the stack must end empty.",
        lambda r: [_word(r, 0, 10, alphabet) if r.random() < 0.5 else _nested(r, pairs)],
        (("",), (opens[0] + closes[1],), (closes[0],)),
        "balanced",
        {"pairs": pairs},
    )


def _nested(rng: random.Random, pairs: Sequence[str]) -> str:
    out = ""
    for _ in range(rng.randint(1, 3)):
        p = rng.choice(pairs)
        out = p[0] + out + p[1] if rng.random() < 0.5 else out + p
    return out


def _t_most_common(rng: random.Random) -> FnProblem:
    m = rng.randint(2, 4)
    vocab = [_word(rng, 1, 5, "abcde") for _ in range(5)]
    return FnProblem(
        "most_common_word",
        "def most_common_word(s: str) -> str",
        f"s is words separated by single spaces. It returns the most frequent word with at least {m} letters; "
        "ties go to the alphabetically smallest word; '' if there is no such word.",
        "def most_common_word(s: str) -> str:\n    counts = {}\n    for w in s.split():\n"
        f"        if len(w) >= {m}:\n            counts[w] = counts.get(w, 0) + 1\n"
        "    if not counts:\n        return ''\n    return min(counts, key=lambda w: (-counts[w], w))\n",
        f"Count words of length >= {m} in a dict, then take the minimum by (-count, word).",
        lambda r: [" ".join(r.choice(vocab) for _ in range(r.randint(0, 8)))],
        (("",), ("a b",)),
        "most_common",
        {"m": m},
    )


def _t_rotate(rng: random.Random) -> FnProblem:
    right = rng.random() < 0.5
    d = "right" if right else "left"
    expr = "xs[-k:] + xs[:-k]" if right else "xs[k:] + xs[:k]"
    return FnProblem(
        f"rotate_{d}",
        f"def rotate_{d}(xs: list[int], k: int) -> list[int]",
        f"It returns xs rotated {d} by k positions (k >= 0, possibly larger than len(xs)); an empty list stays empty.",
        f"def rotate_{d}(xs: list[int], k: int) -> list[int]:\n    if not xs:\n        return []\n"
        f"    k %= len(xs)\n    return {expr}\n",
        f"Reduce k modulo len(xs), then concatenate two slices: {expr}.",
        lambda r: [_ints(r, 0, 7), r.randint(0, 12)],
        (([], 3), ([1, 2, 3], 0), ([1, 2, 3], 3)),
        "rotate",
        {"dir": d},
    )


def _t_fizz(rng: random.Random) -> FnProblem:
    a, b = rng.sample([2, 3, 4, 5, 7], 2)
    wa, wb = rng.sample(["Fizz", "Buzz", "Foo", "Bar", "Zap"], 2)
    return FnProblem(
        "fizz",
        "def fizz(n: int) -> list[str]",
        f"It returns a list of n strings for i = 1..n: {wa + wb!r} if i is a multiple of both {a} and {b}, "
        f"{wa!r} for a multiple of {a} only, {wb!r} for a multiple of {b} only, else str(i).",
        "def fizz(n: int) -> list[str]:\n    out = []\n    for i in range(1, n + 1):\n"
        f"        s = ({wa!r} if i % {a} == 0 else '') + ({wb!r} if i % {b} == 0 else '')\n"
        "        out.append(s or str(i))\n    return out\n",
        "Build each entry by concatenating the words of the divisors that divide i, falling back to str(i).",
        lambda r: [r.randint(0, 3 * a * b)],
        ((0,), (1,), (a * b,)),
        "fizz",
        {"a": a, "b": b, "wa": wa, "wb": wb},
    )


FN_TEMPLATES: dict[int, tuple[Callable[[random.Random], FnProblem], ...]] = {
    1: (_t_sum_divisible, _t_count_above, _t_affine, _t_reverse_suffix, _t_poly),
    2: (_t_count_chars, _t_caesar, _t_running, _t_digit_sum, _t_rle),
    3: (_t_longest_run, _t_balanced, _t_most_common, _t_rotate, _t_fizz),
}
"""Templates by difficulty: 1 = one expression, 2 = a loop or a character transform, 3 = state over a scan."""


# --------------------------------------------------------------------------- bug-fix repo templates


@dataclass(frozen=True)
class BugSite:
    """One place a bug can be injected.

    Attributes:
        path: the source file.
        fixed: a fragment of the correct source, unique in that file.
        buggy: what replaces it.
        kind: ``off-by-one`` / ``wrong operator`` / ``wrong variable``.
        why: one sentence on why the buggy fragment is wrong (for the reference solver).
        level: 1 for a bug in the module the tests import directly, 2 for a helper module.
    """

    path: str
    fixed: str
    buggy: str
    kind: str
    why: str
    level: int


@dataclass(frozen=True)
class RepoTemplate:
    """A tiny repo: source files (formatted with drawn params), one test file, bug sites, call generators.

    Attributes:
        key: template name.
        draw: draws the parameters (``dict``) from an rng.
        sources: path -> source template (``str.format`` with the params).
        test_path: the visible test module's path.
        top: the module the tests exercise as a whole (its functions call the helper).
        sites: candidate bug sites (fragments are also formatted with the params).
        calls: (module, function, argument generator(rng, params)) triples.
    """

    key: str
    draw: Callable[[random.Random], dict[str, Any]]
    sources: Mapping[str, str]
    test_path: str
    top: str
    sites: tuple[BugSite, ...]
    calls: tuple[tuple[str, str, Callable[[random.Random, Mapping[str, Any]], list[Any]]], ...]


def _scores(r: random.Random, p: Mapping[str, Any]) -> list[int]:
    xs = [r.randint(0, 100) for _ in range(r.randint(1, 6))]
    if r.random() < 0.5:
        xs[r.randrange(len(xs))] = p["threshold"]
    return xs


_GRADES = RepoTemplate(
    key="grades",
    draw=lambda r: {"threshold": r.choice([40, 50, 60, 70])},
    sources={
        "scoring.py": (
            '"""Score helpers."""\n\n\n'
            "def average(xs):\n"
            "    if not xs:\n"
            "        return 0\n"
            "    return sum(xs) // len(xs)\n\n\n"
            "def passed(score):\n"
            "    return score >= {threshold}\n"
        ),
        "report.py": (
            '"""One-line reports of a list of scores."""\n\n'
            "from scoring import average, passed\n\n\n"
            "def summary(scores):\n"
            "    avg = average(scores)\n"
            "    n_pass = len([s for s in scores if passed(s)])\n"
            '    return f"avg={{avg}} pass={{n_pass}}/{{len(scores)}}"\n\n\n'
            "def top_score(scores):\n"
            "    best = scores[0]\n"
            "    for s in scores[1:]:\n"
            "        if s > best:\n"
            "            best = s\n"
            "    return best\n"
        ),
    },
    test_path="test_report.py",
    top="report",
    sites=(
        BugSite("scoring.py", "score >= {threshold}", "score > {threshold}", "wrong operator",
                "a score equal to the threshold {threshold} must pass, so the comparison must be >=", 2),
        BugSite("scoring.py", "sum(xs) // len(xs)", "sum(xs[1:]) // len(xs)", "off-by-one",
                "the average must include the first element, not skip it with xs[1:]", 2),
        BugSite("report.py", 'f"avg={{avg}} pass=', 'f"avg={{n_pass}} pass=', "wrong variable",
                "the avg= field must show the average avg, not the pass count n_pass", 1),
        BugSite("report.py", "for s in scores[1:]:", "for s in scores[2:]:", "off-by-one",
                "the loop must look at every score after the first (scores[1:]), scores[2:] skips one", 1),
    ),
    calls=(
        ("scoring", "average", lambda r, p: [_scores(r, p)]),
        ("scoring", "passed", lambda r, p: [r.choice([p["threshold"], p["threshold"] - 1, r.randint(0, 100)])]),
        ("report", "summary", lambda r, p: [_scores(r, p)]),
        ("report", "top_score", lambda r, p: [_scores(r, p)]),
    ),
)


def _items(r: random.Random) -> list[list[int]]:
    return [[r.randint(1, 50), r.randint(1, 5)] for _ in range(r.randint(1, 4))]


_CART = RepoTemplate(
    key="cart",
    draw=lambda r: {"tax": r.choice([5, 10, 20, 25])},
    sources={
        "pricing.py": (
            '"""Prices in whole cents."""\n\n'
            "TAX_PERCENT = {tax}\n\n\n"
            "def line_total(price, qty):\n"
            "    return price * qty\n\n\n"
            "def with_tax(amount):\n"
            "    return amount + amount * TAX_PERCENT // 100\n"
        ),
        "cart.py": (
            '"""A shopping cart: a list of [price, qty] items."""\n\n'
            "from pricing import line_total, with_tax\n\n\n"
            "def cart_total(items):\n"
            "    subtotal = 0\n"
            "    for price, qty in items:\n"
            "        subtotal += line_total(price, qty)\n"
            "    return with_tax(subtotal)\n\n\n"
            "def most_expensive(items):\n"
            "    best = items[0]\n"
            "    for item in items[1:]:\n"
            "        if item[0] > best[0]:\n"
            "            best = item\n"
            "    return best[0]\n"
        ),
    },
    test_path="test_cart.py",
    top="cart",
    sites=(
        BugSite("pricing.py", "return price * qty", "return price + qty", "wrong operator",
                "a line total is price times quantity, not price plus quantity", 2),
        BugSite("pricing.py", "amount + amount * TAX_PERCENT // 100", "amount + amount * TAX_PERCENT // 10",
                "wrong operator", "a percentage is divided by 100, not by 10", 2),
        BugSite("cart.py", "return with_tax(subtotal)", "return with_tax(price)", "wrong variable",
                "tax must be applied to the whole subtotal, not to the last price", 1),
        BugSite("cart.py", "if item[0] > best[0]:", "if item[1] > best[0]:", "wrong variable",
                "items are compared by price item[0]; item[1] is the quantity", 1),
    ),
    calls=(
        ("pricing", "line_total", lambda r, p: [r.randint(1, 50), r.randint(2, 5)]),
        ("pricing", "with_tax", lambda r, p: [r.randint(10, 500)]),
        ("cart", "cart_total", lambda r, p: [_items(r)]),
        ("cart", "most_expensive", lambda r, p: [_items(r)]),
    ),
)


def _text(r: random.Random) -> str:
    return " ".join(_word(r, 1, 8, "abcdeXYZ") for _ in range(r.randint(1, 5)))


_TEXT = RepoTemplate(
    key="text",
    draw=lambda r: {"ellipsis": r.choice(["~", "..", "+", "*"])},
    sources={
        "textutil.py": (
            '"""Word helpers."""\n\n\n'
            "def words(text):\n"
            "    return [w.lower() for w in text.split()]\n\n\n"
            "def shorten(word, n):\n"
            "    if len(word) <= n:\n"
            "        return word\n"
            "    return word[:n] + {ellipsis!r}\n"
        ),
        "headline.py": (
            '"""Headlines and longest words."""\n\n'
            "from textutil import shorten, words\n\n\n"
            "def longest_word(text):\n"
            '    best = ""\n'
            "    for w in words(text):\n"
            "        if len(w) > len(best):\n"
            "            best = w\n"
            "    return best\n\n\n"
            "def headline(text, n):\n"
            '    return " ".join(shorten(w, n) for w in words(text))\n'
        ),
    },
    test_path="test_headline.py",
    top="headline",
    sites=(
        BugSite("textutil.py", "if len(word) <= n:", "if len(word) < n:", "off-by-one",
                "a word of exactly n letters fits and must be kept whole, so the test is <=", 2),
        BugSite("textutil.py", "word[:n] +", "word[:n - 1] +", "off-by-one",
                "a shortened word keeps its first n letters, word[:n], not n - 1", 2),
        BugSite("headline.py", "if len(w) > len(best):", "if len(w) >= len(best):", "wrong operator",
                "the first of equally long words must win, so a tie must not replace best (>)", 1),
        BugSite("headline.py", '" ".join(shorten(w, n) for', '" ".join(shorten(w, n - 1) for', "off-by-one",
                "each word is shortened to n letters, not n - 1", 1),
    ),
    calls=(
        ("textutil", "shorten", lambda r, p: [_word(r, 1, 8), r.randint(2, 6)]),
        ("textutil", "words", lambda r, p: [_text(r)]),
        ("headline", "longest_word", lambda r, p: [_text(r)]),
        ("headline", "headline", lambda r, p: [_text(r), r.randint(2, 5)]),
    ),
)


_WINDOW = RepoTemplate(
    key="window",
    draw=lambda r: {"k": r.choice([2, 3])},
    sources={
        "counter.py": (
            '"""Counting helpers."""\n\n\n'
            "def count_in_range(xs, lo, hi):\n"
            "    total = 0\n"
            "    for x in xs:\n"
            "        if lo <= x <= hi:\n"
            "            total += 1\n"
            "    return total\n\n\n"
            "def window_sums(xs, k):\n"
            "    return [sum(xs[i:i + k]) for i in range(len(xs) - k + 1)]\n"
        ),
        "window.py": (
            '"""Sliding-window statistics with window size {k}."""\n\n'
            "from counter import count_in_range, window_sums\n\n\n"
            "def busiest(xs):\n"
            "    sums = window_sums(xs, {k})\n"
            "    return sums.index(max(sums))\n\n\n"
            "def hot_windows(xs, lo, hi):\n"
            "    return count_in_range(window_sums(xs, {k}), lo, hi)\n"
        ),
    },
    test_path="test_window.py",
    top="window",
    sites=(
        BugSite("counter.py", "range(len(xs) - k + 1)", "range(len(xs) - k)", "off-by-one",
                "there are len(xs) - k + 1 windows; range(len(xs) - k) drops the last one", 2),
        BugSite("counter.py", "if lo <= x <= hi:", "if lo < x <= hi:", "wrong operator",
                "the range is inclusive at both ends, so lo itself counts (<=)", 2),
        BugSite("counter.py", "total += 1", "total += x", "wrong variable",
                "the function counts elements, so it adds 1 per element, not the element x", 2),
        BugSite("window.py", "return sums.index(max(sums))", "return sums.index(min(sums))", "wrong operator",
                "the busiest window has the largest sum, max, not min", 1),
    ),
    calls=(
        ("counter", "count_in_range", lambda r, p: [_ints(r, 1, 8, 0, 9), r.randint(0, 4), r.randint(4, 9)]),
        ("counter", "window_sums", lambda r, p: [_ints(r, 3, 7, 0, 9), p["k"]]),
        ("window", "busiest", lambda r, p: [_ints(r, p["k"] + 1, 8, 0, 9)]),
        ("window", "hot_windows", lambda r, p: [_ints(r, p["k"] + 1, 8, 0, 9), r.randint(0, 8), r.randint(8, 20)]),
    ),
)

REPO_TEMPLATES: tuple[RepoTemplate, ...] = (_GRADES, _CART, _TEXT, _WINDOW)
"""The bug-fix repo templates (2 source modules and a test module each, 4 bug sites each)."""
