"""The three AET families (SPEC §3.5, issue 21); the verify-in-the-loop machinery is in `aet`.

``coding.aet_cli`` (domain coding: the deliverable is a program)
    Make ``tally.py`` satisfy SPEC.md: sum ``KEY<sep>VALUE`` lines per key, with comments, blank
    lines, malformed input (exit 1), bad flags (exit 2), and by difficulty case folding, ``--min``
    and ``--top``. Hidden scenarios are the spec's edge cases and fresh inputs.

``agents.aet_datadir`` (domain agents: the deliverable is a state of the filesystem, reached with tools)
    Turn ``data/raw/*.csv`` into ``data/clean/<region>.csv`` plus ``summary.json`` under
    constraints (raw data untouched, nothing else in ``data/clean``). Public scenarios check one or
    two regions; hidden ones check the rest, the summary and both constraints.

``agents.aet_config`` (domain agents: configuration and operations work, no code is written)
    Configure ``config/*.json`` of a small router project so that ``python -m app.router ENV PATH``
    routes as the requirements say in every environment. Only ``config/`` is writable: the hidden
    verifier restores every other file and drops every file the agent added elsewhere, so only
    configuration counts. Hidden scenarios are other paths under
    each route, segment boundaries, unrouted paths and an unknown environment.

Expected values come from the reference program (CLI, data transform) or the reference config run
through the project's own router, executed on the host at generation time, so the reference
solver's files reproduce them by construction and the tests check that they do in the sandbox.
"""

from __future__ import annotations

import json
import random
from typing import Any

from k3post.envs.families.aet.core import AETFamily, Turn
from k3post.envs.families.registry import register_family
from k3post.envs.task import Task

__all__ = ["CLI", "DATADIR", "CONFIG", "tally_source", "transform_source", "ROUTER_SOURCE"]


def _exec(source: str, name: str) -> Any:
    """Function ``name`` of our own generated ``source`` (executed on the host)."""
    ns: dict[str, Any] = {"__name__": "k3post_aet_reference"}
    exec(compile(source, f"<aet {name}>", "exec"), ns)  # noqa: S102 - generated reference code
    return ns[name]


_WORDS = ("apple", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor", "iris", "juniper", "kelp",
          "lumen", "maple", "nova", "onyx", "pine", "quartz", "raven", "sage", "tundra")


# --------------------------------------------------------------------------- coding.aet_cli


def tally_source(sep: str, decimals: int, fold: bool, flags: tuple[str, ...]) -> str:
    """The reference ``tally.py``: ``run(argv, text) -> (exit code, stdout)`` plus a ``__main__`` wrapper."""
    key = "parts[0].strip().lower()" if fold else "parts[0].strip()"
    return f'''"""tally: sum the values of KEY{sep}VALUE lines per key (see SPEC.md)."""
import sys

FLAGS = {flags!r}


def run(argv, text):
    """(exit code, stdout) of `python tally.py ARGV` with `text` on stdin."""
    opts = {{}}
    i = 0
    while i < len(argv):
        if argv[i] not in FLAGS or i + 1 >= len(argv):
            return 2, ""
        try:
            opts[argv[i]] = float(argv[i + 1]) if argv[i] == "--min" else int(argv[i + 1])
        except ValueError:
            return 2, ""
        i += 2
    if opts.get("--top", 1) < 1:
        return 2, ""
    totals = {{}}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split({sep!r})
        if len(parts) != 2 or not parts[0].strip():
            return 1, ""
        key = {key}
        try:
            value = float(parts[1].strip())
        except ValueError:
            return 1, ""
        totals[key] = totals.get(key, 0.0) + value
    items = sorted(totals.items())
    if "--min" in opts:
        items = [(k, v) for k, v in items if v >= opts["--min"]]
    if "--top" in opts:
        items = sorted(items, key=lambda kv: (-kv[1], kv[0]))[: opts["--top"]]
    return 0, "".join(f"{{k}}{sep}{{v:.{decimals}f}}\\n" for k, v in items)


if __name__ == "__main__":
    code, out = run(sys.argv[1:], sys.stdin.read())
    sys.stdout.write(out)
    if code:
        print("tally: error", file=sys.stderr)
    sys.exit(code)
'''


_CLI_STUB = '"""tally: see SPEC.md."""\nimport sys\n\nprint("tally: not implemented", file=sys.stderr)\nsys.exit(1)\n'


class CliFamily(AETFamily):
    """``coding.aet_cli``: make a small CLI satisfy its spec; hidden edge cases decide."""

    name = "coding.aet_cli"
    domain = "coding"
    description = "AET: make tally.py satisfy SPEC.md; public verifier via submit (budgeted), hidden edge cases decide."
    id_prefix = "aetcli"
    spec_file = "SPEC.md"

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        sep = rng.choice([",", ";", "|", ":"])
        decimals = rng.choice([0, 1, 2])
        fold = difficulty >= 2
        flags = ("--min", "--top")[: difficulty - 1]
        src = tally_source(sep, decimals, fold, flags)
        run = _exec(src, "run")
        keys = rng.sample(_WORDS, 6)

        def data(n: int, mixed_case: bool = False) -> str:
            lines = []
            for _ in range(n):
                k = rng.choice(keys[:4])
                if mixed_case and rng.random() < 0.4:
                    k = k.capitalize()
                v = rng.choice([str(rng.randint(-5, 40)), f"{rng.uniform(0, 20):.2f}"])
                lines.append(f"{k}{sep}{v}")
            return "\n".join(lines) + "\n"

        def sc(argv: list[str], stdin: str) -> dict[str, Any]:
            code, out = run(argv, stdin)
            return {"argv": ["tally.py", *argv], "stdin": stdin, "expected": {"rc": code, "stdout": out}}

        f = rng.choice(flags) if flags else ""
        opt = [f, str(rng.randint(1, 3) if f == "--top" else rng.randint(0, 30))] if f else []
        public = [sc([], data(5)), sc([], data(7)), sc(opt, data(6))]
        k1, k2 = keys[4], keys[5]
        hidden = [
            sc([], ""),
            sc([], f"# header\n\n{k1}{sep}2\n   \n# {k2}{sep}100\n{k1}{sep}3\n"),
            sc([], f"  {k1} {sep} 1.5 \n{k2}{sep}-4\n{k1}{sep}-0.5\n"),
            sc([], f"{k1}{sep}1\n{k2} 2\n"),
            sc([], f"{k1}{sep}one\n"),
            sc([], f"{k1}{sep}1{sep}2\n"),
            sc(["--bogus", "1"], f"{k1}{sep}1\n"),
            sc([], data(9, mixed_case=fold)),
        ]
        if fold:
            hidden.append(sc([], f"{k1.upper()}{sep}1\n{k1}{sep}2\n{k1.capitalize()}{sep}3\n"))
        if "--min" in flags:
            hidden += [sc(["--min", "5"], data(8)), sc(["--min", "x"], data(2)), sc(["--min"], data(2))]
        if "--top" in flags:
            hidden += [sc(["--top", "2"], f"{k1}{sep}3\n{k2}{sep}3\n{keys[0]}{sep}1\n"), sc(["--top", "0"], data(3)),
                       sc(["--top", "1", "--min", "0"], data(8))]
        rules = [
            f"`python tally.py [OPTIONS]` reads lines `KEY{sep}VALUE` on stdin and prints one line `KEY{sep}TOTAL` "
            "per key: the sum of its values, keys in ascending (string) order.",
            f"TOTAL is printed with exactly {decimals} decimal places (Python's `f\"{{total:.{decimals}f}}\"`).",
            "Blank lines (after stripping whitespace) and lines starting with `#` are ignored; spaces around KEY and "
            "VALUE are ignored.",
            f"A line that does not split into exactly two fields on `{sep}`, has an empty KEY, or a VALUE that is not "
            "a number (Python `float`) is an error: print nothing on stdout, exit with code 1.",
            "Empty input prints nothing and exits 0.",
        ]
        if fold:
            rules.append("Keys are case-insensitive: they are lower-cased before summing and printing.")
        if "--min" in flags:
            rules.append("`--min X` (a number) keeps only keys whose total is >= X.")
        if "--top" in flags:
            rules.append("`--top N` (an int >= 1) prints only the N largest totals, largest first, ties by key; "
                         "applied after `--min`.")
        allowed = ", ".join(f"`{f} VALUE`" for f in flags) or "none"
        rules.append(f"Options: {allowed}. Any other argument, a missing or malformed option value, or an invalid "
                     "option value prints nothing on stdout and exits with code 2 (stderr is free text).")
        spec = "# tally\n\n" + "\n".join(f"{i + 1}. {r}" for i, r in enumerate(rules)) + "\n"
        goal = ("Make the command-line tool tally.py satisfy its specification in SPEC.md (the current tally.py is a "
                "stub). It runs with the system Python 3, standard library only.")
        return self.task_from(
            task_id, goal=goal, difficulty=difficulty,
            constraints=["tally.py must follow SPEC.md exactly (stdout and exit codes are checked).",
                         "Only the standard library is available."],
            files={"SPEC.md": spec, "tally.py": _CLI_STUB}, public=public, hidden=hidden,
            solution={"tally.py": src}, sep=sep,
        )

    def work_turns(self, task: Task, effort: str) -> list[Turn]:
        """Write the implementation; at high / max try one public scenario by hand first."""
        md = task.metadata
        why = {"low": "",
               "high": "Implement every rule of SPEC.md, including the error exit codes.",
               "max": (f"SPEC.md gives the format KEY{md['sep']}VALUE, sorted keys, fixed decimals, ignored blank and "
                       "comment lines, exit 1 on malformed lines and exit 2 on bad options. I parse the options first, "
                       "then sum per key with float, then filter and sort, and print nothing on any error.")}[effort]
        turns: list[Turn] = [(why, [("write_file", {"path": "tally.py", "content": md["solution"]["tally.py"]})])]
        if effort != "low":
            first = md["public"][0]
            turns.append(("Try the first public scenario by hand." if effort == "max" else "",
                          [("run_command", {"command": "python " + " ".join(first["argv"]), "stdin": first["stdin"]})]))
        return turns

    def overfit_turns(self, task: Task) -> list[Turn]:
        """A tally.py that looks up the public scenarios' outputs and prints nothing otherwise."""
        table = {json.dumps([sc["argv"][1:], sc["stdin"]]): [sc["expected"]["rc"], sc["expected"]["stdout"]]
                 for sc in task.metadata["public"]}
        src = ("import json, sys\n"
               f"T = {table!r}\n"
               "rc, out = T.get(json.dumps([sys.argv[1:], sys.stdin.read()]), [0, ''])\n"
               "sys.stdout.write(out)\nsys.exit(rc)\n")
        return [("", [("write_file", {"path": "tally.py", "content": src}), ("submit", {})])]

    def extra_wrong_turns(self, task: Task) -> dict[str, list[Turn]]:
        """An implementation that ignores the edge-case rules (comments, errors, options)."""
        sep = task.metadata["sep"]
        naive = ("import sys\nt = {}\nfor line in sys.stdin.read().splitlines():\n"
                 f"    k, v = line.split({sep!r})\n    t[k] = t.get(k, 0) + float(v)\n"
                 f"for k in sorted(t):\n    print(f'{{k}}{sep}{{t[k]:.2f}}')\n")
        return {"happy_path_only": [("", [("write_file", {"path": "tally.py", "content": naive})])]}


# --------------------------------------------------------------------------- agents.aet_datadir


def transform_source() -> str:
    """The reference ``transform.py``: ``transform(raw: {name: csv text}) -> {path: text}`` plus file IO."""
    return '''"""Clean data/raw/*.csv into data/clean/ (see GOAL.md)."""
import json
import os


def transform(raw):
    """{file name: csv text} -> {path under data/clean: text}."""
    rows = set()
    for name in sorted(raw):
        for line in raw[name].splitlines()[1:]:
            parts = line.split(",")
            if len(parts) != 3:
                continue
            date, region, amount = (p.strip() for p in parts)
            try:
                value = float(amount)
            except ValueError:
                continue
            if date and region:
                rows.add((date, region.lower(), value))
    out, summary = {}, {}
    for region in sorted({r for _, r, _ in rows}):
        mine = sorted((d, v) for d, r, v in rows if r == region)
        out[region + ".csv"] = "date,amount\\n" + "".join(f"{d},{v:.2f}\\n" for d, v in mine)
        summary[region] = {"rows": len(mine), "total": round(sum(v for _, v in mine), 2)}
    out["summary.json"] = json.dumps(summary, indent=1, sort_keys=True) + "\\n"
    return out


if __name__ == "__main__":
    raw = {}
    for name in sorted(os.listdir("data/raw")):
        if name.endswith(".csv"):
            with open(os.path.join("data/raw", name), encoding="utf-8") as fh:
                raw[name] = fh.read()
    os.makedirs("data/clean", exist_ok=True)
    for path, text in transform(raw).items():
        with open(os.path.join("data/clean", path), "w", encoding="utf-8") as fh:
            fh.write(text)
'''


_REGIONS = ("north", "south", "east", "west", "central", "coast", "hills", "valley")
_SOURCES = ("shop_a", "shop_b", "web", "kiosk", "partner")


class DatadirFamily(AETFamily):
    """``agents.aet_datadir``: bring a data directory into a target state under constraints."""

    name = "agents.aet_datadir"
    domain = "agents"
    description = "AET: clean data/raw into data/clean (per-region CSVs + summary) without touching raw; hidden checks decide."
    id_prefix = "aetdir"

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        regions = rng.sample(_REGIONS, 3 + difficulty // 2)
        sources = rng.sample(_SOURCES, 1 + difficulty)
        raw: dict[str, str] = {}
        pool: list[str] = []
        for s in sources:
            lines = ["date,region,amount"]
            for _ in range(rng.randint(6, 9)):
                r = rng.choice(regions)
                if difficulty >= 3 and rng.random() < 0.3:
                    r = rng.choice([r.upper(), r.capitalize(), f" {r} "])
                line = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d},{r},{rng.uniform(1, 500):.2f}"
                lines.append(line)
                pool.append(line)
            lines.append(f"2026-0{rng.randint(1, 9)}-1{rng.randint(0, 9)},{rng.choice(regions)},{rng.choice(['', 'n/a', '?'])}")
            if difficulty >= 2:
                lines.append(rng.choice(pool))  # a duplicate row (maybe from another source)
            body = lines[1:]
            rng.shuffle(body)
            raw[f"data/raw/{s}.csv"] = "\n".join([lines[0], *body]) + "\n"
        src = transform_source()
        out = {f"data/clean/{p}": t for p, t in _exec(src, "transform")({p.rsplit("/", 1)[1]: t for p, t in raw.items()}).items()}
        got = sorted(p.rsplit("/", 1)[1][:-4] for p in out if p.endswith(".csv"))
        if len(got) < 3:
            return None
        pub = sorted(rng.sample(got, 1 + (len(got) > 3)))
        public = [{"read": [f"data/clean/{r}.csv"], "expected": {"files": {f"data/clean/{r}.csv": out[f"data/clean/{r}.csv"]}}}
                  for r in pub]
        hidden = [{"read": [p], "expected": {"files": {p: t}}} for p, t in sorted(out.items())]
        hidden.append({"read": sorted(raw), "expected": {"files": dict(raw)}})
        hidden.append({"list": ["data/clean"], "expected": {"list": {"data/clean": sorted(p.rsplit("/", 1)[1] for p in out)}}})
        goal_md = (
            "# Goal\n\nClean the sales records in data/raw/*.csv (header `date,region,amount`) into data/clean/:\n\n"
            "1. Read every data row of every data/raw/*.csv (skip each file's header line).\n"
            "2. Strip spaces around fields; region names are lower-cased.\n"
            "3. Drop a row that does not have exactly 3 fields, has an empty date or region, or whose amount is not "
            "a number (Python `float`).\n"
            "4. Rows with the same date, region and amount (as a number) are duplicates: keep one.\n"
            "5. For every region write data/clean/<region>.csv: the line `date,amount`, then one line `DATE,AMOUNT` "
            "per row with the amount to 2 decimals, sorted by date, then amount.\n"
            "6. Write data/clean/summary.json: an object mapping each region to "
            "`{\"rows\": <row count>, \"total\": <sum of amounts rounded to 2 decimals>}`.\n"
        )
        return self.task_from(
            task_id, difficulty=difficulty,
            goal="Transform the data directory into the target state described in GOAL.md.",
            constraints=["Leave every file under data/raw/ exactly as it is.",
                         "data/clean/ must end up holding exactly the per-region CSVs and summary.json, nothing else.",
                         "Tools run in a sandbox with the system Python 3 (standard library only)."],
            files={"GOAL.md": goal_md, **raw}, public=public, hidden=hidden, solution={"transform.py": src},
        )

    def work_turns(self, task: Task, effort: str) -> list[Turn]:
        """Write a transform script outside data/, run it, list the result."""
        why = {"low": "",
               "high": "Write one script that applies every rule of GOAL.md, run it, then check the output.",
               "max": ("The rules: normalise fields, drop malformed rows and duplicates, one sorted CSV per region and a "
                       "summary. A script in the working directory (not under data/) keeps data/clean clean, and "
                       "reading data/raw without writing it respects the constraint.")}[effort]
        turns: list[Turn] = [(why, [("write_file", {"path": "transform.py", "content": task.metadata["solution"]["transform.py"]}),
                                    ("run_command", {"command": "python transform.py"})])]
        if effort != "low":
            turns.append(("List the files to check the result." if effort == "max" else "", [("list_files", {})]))
        return turns

    def _outputs(self, task: Task) -> dict[str, str]:
        return {p: sc["expected"]["files"][p] for sc in task.metadata["hidden"] for p in sc.get("read", [])
                if p.startswith("data/clean/")}

    def overfit_turns(self, task: Task) -> list[Turn]:
        """Write exactly the public scenarios' expected files and nothing else."""
        calls = [("write_file", {"path": p, "content": t}) for sc in task.metadata["public"] for p, t in sc["expected"]["files"].items()]
        return [("", [*calls, ("submit", {})])]

    def extra_wrong_turns(self, task: Task) -> dict[str, list[Turn]]:
        """Right outputs but raw data edited in place, or an extra file in data/clean."""
        outs = [("write_file", {"path": p, "content": t}) for p, t in self._outputs(task).items()]
        first_raw = next(p for p in sorted(task.metadata["files"]) if p.startswith("data/raw/"))
        return {
            "tampers_with_raw": [("", [*outs, ("write_file", {"path": first_raw, "content": "date,region,amount\n"})])],
            "extra_file_in_clean": [("", [*outs, ("write_file", {"path": "data/clean/notes.txt", "content": "done\n"})])],
        }


# --------------------------------------------------------------------------- agents.aet_config


ROUTER_SOURCE = '''"""Route a request path to a backend service: `python -m app.router ENV PATH` (see app/README.md)."""
import json
import os
import sys


def merge(base, over):
    """Deep merge: dicts merge key by key, anything else in `over` replaces."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def route(cfg, path):
    """(exit code, stdout) for `path` under the merged config `cfg`."""
    best = None
    for prefix, service in cfg.get("routes", {}).items():
        if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, service)
    if best is None:
        return 1, "no route\\n"
    spec = cfg.get("services", {}).get(best[1])
    if not isinstance(spec, dict) or any(k not in spec for k in ("host", "port", "timeout_s")):
        return 3, ""
    return 0, f"{best[1]} {spec['host']}:{spec['port']} timeout={spec['timeout_s']}\\n"


def main(argv):
    if len(argv) != 2:
        print("usage: python -m app.router ENV PATH", file=sys.stderr)
        return 2
    env, path = argv
    overlay = os.path.join("config", env + ".json")
    if not os.path.exists(overlay):
        print(f"unknown environment {env!r}", file=sys.stderr)
        return 2
    try:
        with open(os.path.join("config", "base.json"), encoding="utf-8") as fh:
            cfg = json.load(fh)
        with open(overlay, encoding="utf-8") as fh:
            cfg = merge(cfg, json.load(fh))
    except (OSError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 3
    code, out = route(cfg, path)
    sys.stdout.write(out)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''

_ROUTER_README = """# router

`python -m app.router ENV PATH` prints `SERVICE HOST:PORT timeout=TIMEOUT` for the service that serves PATH in
environment ENV, `no route` (exit 1) when no route matches, exit 2 for an unknown environment, exit 3 for a
broken configuration.

Configuration: config/base.json, deep-merged with config/ENV.json (the file must exist for ENV to be known;
`{}` is a valid overlay). Keys:

- `services`: {name: {"host": str, "port": int, "timeout_s": int}}
- `routes`: {prefix: service name}. A prefix matches PATH when PATH equals it or continues it after a `/`
  (`/api` matches `/api/x`, not `/apix`); the longest matching prefix wins.

Values are printed as written in the JSON (write ports and timeouts as integers).
"""

_SERVICES = ("users", "orders", "billing", "search", "auth", "media", "stock")


class ConfigFamily(AETFamily):
    """``agents.aet_config``: configure a multi-file project so its hidden integration checks pass."""

    name = "agents.aet_config"
    domain = "agents"
    description = "AET: configure config/*.json so `python -m app.router ENV PATH` meets the requirements; app/ is protected."
    id_prefix = "aetcfg"
    spec_file = "app/README.md"
    writable = ("config/",)

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        envs = ["prod", "staging", "dev"][:difficulty]
        names = rng.sample(_SERVICES, 2 + (difficulty > 1))
        services = {n: {"host": f"10.0.{rng.randint(1, 9)}.{rng.randint(2, 250)}", "port": rng.choice(range(8001, 8100)),
                        "timeout_s": rng.choice([2, 3, 5, 10])} for n in names}
        services["gateway"] = {"host": f"10.0.0.{rng.randint(2, 250)}", "port": 8000, "timeout_s": 30}
        routes = {"/api": "gateway", **{f"/api/{n}": n for n in names}}
        overlays: dict[str, dict[str, Any]] = {"prod": {}}
        if "staging" in envs:
            n = rng.choice(names)
            overlays["staging"] = {"services": {n: {"host": f"10.1.0.{rng.randint(2, 250)}"}}}
        if "dev" in envs:
            n = rng.choice(names)
            overlays["dev"] = {"services": {n: {"port": 9000 + rng.randint(1, 99), "timeout_s": 60}},
                               "routes": {"/debug": n}}
        base = {"services": services, "routes": routes}
        merge, route = _exec(ROUTER_SOURCE, "merge"), _exec(ROUTER_SOURCE, "route")

        def sc(env: str, path: str) -> dict[str, Any]:
            code, out = route(merge(base, overlays[env]), path)
            return {"argv": ["-m", "app.router", env, path], "expected": {"rc": code, "stdout": out}}

        def sub() -> str:
            return f"{rng.randint(1, 999)}"

        public = [sc("prod", f"/api/{names[0]}/{sub()}"), sc(envs[-1], f"/api/{names[-1]}/{sub()}/items"),
                  sc(envs[0], f"/api/status/{sub()}")]
        hidden = []
        for env in envs:
            for n in names:
                hidden += [sc(env, f"/api/{n}"), sc(env, f"/api/{n}/{sub()}"), sc(env, f"/api/{n}x/{sub()}")]
            hidden += [sc(env, "/api"), sc(env, f"/apix/{sub()}"), sc(env, "/"), sc(env, f"/debug/{sub()}")]
        hidden.append({"argv": ["-m", "app.router", "qa", "/api"], "expected": {"rc": 2, "stdout": ""}})
        # the starting point: one service missing, one route pointing at a misspelt service, no env overlays
        broken = {"services": {k: v for k, v in services.items() if k != names[-1]},
                  "routes": {**routes, f"/api/{names[0]}": names[0][:-1]}}
        lines = ["Services (base values):"]
        lines += [f"- {n}: host {s['host']}, port {s['port']}, timeout {s['timeout_s']} s" for n, s in services.items()]
        lines.append("Routes: " + "; ".join(f"{p} -> {s}" for p, s in routes.items()) + "; nothing else is routed.")
        lines.append("Environments: " + ", ".join(envs) + " (exactly these).")
        for env in envs:
            diff = overlays[env]
            if not diff:
                lines.append(f"- {env}: the base values.")
                continue
            parts = [f"service {n} uses {', '.join(f'{k} {v}' for k, v in ch.items())}" for n, ch in diff.get("services", {}).items()]
            parts += [f"route {p} -> {s} exists (only here)" for p, s in diff.get("routes", {}).items()]
            lines.append(f"- {env}: as base, except: " + "; ".join(parts) + ".")
        goal = ("Configure the router project so that `python -m app.router ENV PATH` routes every request as these "
                "requirements say (see app/README.md for the configuration format):\n\n" + "\n".join(lines))
        return self.task_from(
            task_id, goal=goal, difficulty=difficulty,
            constraints=["Change only files under config/ (every other file is restored to its original state, and files "
                         "added elsewhere are removed, before the checks).",
                         "Every listed environment must work; no other environment may exist."],
            files={"app/__init__.py": "", "app/router.py": ROUTER_SOURCE, "app/README.md": _ROUTER_README,
                   "config/base.json": json.dumps(broken, indent=1) + "\n"},
            protected={"app/__init__.py": "", "app/router.py": ROUTER_SOURCE},
            public=public, hidden=hidden,
            solution={"config/base.json": json.dumps(base, indent=1) + "\n",
                      **{f"config/{e}.json": json.dumps(overlays[e], indent=1) + "\n" for e in envs}},
        )

    def work_turns(self, task: Task, effort: str) -> list[Turn]:
        """Read the current config (high / max), write base.json and one overlay per environment, try a path."""
        sol = task.metadata["solution"]
        turns: list[Turn] = []
        if effort != "low":
            turns.append(("Read the current base config first." if effort == "high" else
                          "Compare the current base config with the requirements: services, ports and routes.",
                          [("read_file", {"path": "config/base.json"})]))
        why = {"low": "",
               "high": "Write the full base config and one overlay per environment.",
               "max": ("The base config misses a service and routes to a misspelt name, and no environment overlay "
                       "exists, so every environment is unknown. Write base.json with all services and routes, then "
                       "one overlay per environment holding only its differences.")}[effort]
        turns.append((why, [("write_file", {"path": p, "content": t}) for p, t in sorted(sol.items())]))
        if effort == "max":
            first = task.metadata["public"][0]
            turns.append(("Try the first public scenario by hand.",
                          [("run_command", {"command": "python " + " ".join(first["argv"])})]))
        return turns

    def overfit_turns(self, task: Task) -> list[Turn]:
        """Routes only the public scenarios' exact paths (right services and overlays otherwise)."""
        sol = {p: json.loads(t) for p, t in task.metadata["solution"].items()}
        base = sol["config/base.json"]
        exact = {}
        for sc in task.metadata["public"]:
            out = sc["expected"]["stdout"].split()
            if sc["expected"]["rc"] == 0:
                exact[sc["argv"][3]] = out[0]
        base = {**base, "routes": exact}
        files = {**{p: json.dumps(v) for p, v in sol.items()}, "config/base.json": json.dumps(base)}
        for p in files:
            if p != "config/base.json":
                over = json.loads(files[p])
                over.pop("routes", None)
                files[p] = json.dumps(over)
        return [("", [*[("write_file", {"path": p, "content": t}) for p, t in sorted(files.items())], ("submit", {})])]

    def extra_wrong_turns(self, task: Task) -> dict[str, list[Turn]]:
        """Rewrite the protected router to print the public answers, or add an environment not asked for."""
        table = {json.dumps(sc["argv"][2:]): sc["expected"]["stdout"] for sc in task.metadata["public"]}
        hacked = f"import json, sys\nT = {table!r}\nsys.stdout.write(T.get(json.dumps(sys.argv[1:]), ''))\n"
        sol = task.metadata["solution"]
        return {
            "rewrites_protected_code": [("", [("write_file", {"path": "app/router.py", "content": hacked})])],
            "extra_environment": [("", [*[("write_file", {"path": p, "content": t}) for p, t in sorted(sol.items())],
                                        ("write_file", {"path": "config/qa.json", "content": "{}\n"})])],
        }


CLI = register_family(CliFamily())
DATADIR = register_family(DatadirFamily())
CONFIG = register_family(ConfigFamily())
