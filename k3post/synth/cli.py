"""Command-line front ends: ``k3post synth``, ``k3post review`` and ``k3post mix``.

`k3post.cli` wires them in with::

    from k3post.synth.cli import add_mix_parser, add_review_parser, add_synth_parser
    add_synth_parser(sub); add_review_parser(sub); add_mix_parser(sub)

Each adds its sub-parser with ``fn`` set to a ``(namespace) -> exit code`` function, as the other
commands do. User errors are ValueErrors (printed as one line by `k3post.cli.main`).

    k3post synth --family general.arithmetic --effort all --n 50 --out data/arith.jsonl
    k3post synth --family general.writing --effort high --n 20 --out data/w.jsonl \
        --teacher-url http://127.0.0.1:8000 --teacher-model my-model --concurrency 16
    k3post review list --queue data/w.review
    k3post review show s-3f9a --queue data/w.review
    k3post review reject s-3f9a --note "off-topic" --queue data/w.review
    k3post mix --in data/arith.jsonl --in data/w.jsonl --weight general/max=2 --n 1000 --out data/mix.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from k3post.constants import EFFORTS as _EFFORTS
from k3post.errors import UserError

__all__ = ["add_synth_parser", "add_synth_tasks_parser", "cmd_synth_tasks", "add_review_parser", "add_mix_parser", "cmd_synth", "cmd_review", "cmd_mix"]



def _split(values: list[str] | None) -> list[str]:
    out: list[str] = []
    for v in values or []:
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def _kv(items: list[str] | None, what: str, cast: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise UserError(f"{what} '{item}': expected KEY=VALUE")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = cast(v)
        except ValueError:
            raise UserError(f"{what} '{item}': {v!r} is not a valid {cast.__name__}") from None
    return out


# --------------------------------------------------------------------------- synth


def add_synth_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``k3post synth``: trajectories from a teacher → verification funnel → SFT JSONL + review queue."""
    p = subparsers.add_parser("synth", help="synthesize verified SFT data from a teacher (reference solver, local model, endpoint)")
    p.add_argument("--family", action="append", required=True, help="task family name(s), comma-separated or repeated; 'all' or a domain for many")
    p.add_argument("--effort", action="append", default=None, help="low, high, max (comma-separated or repeated) or 'all' (default)")
    p.add_argument("--n", type=int, required=True, help="tasks per family (each solved at every effort)")
    p.add_argument("--out", required=True, help="SFT JSONL to write; .raw.jsonl, .rejected.jsonl, .funnel.json and .review/ go next to it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--difficulty", type=int, default=1)
    p.add_argument("--tokenizer", help="tokenizer folder for exact token counts (default: word counts)")
    p.add_argument("--review-dir", help="review queue folder (default: <out stem>.review next to --out)")
    p.add_argument("--budget", action="append", metavar="EFFORT=TOKENS", help="effort budget, e.g. low=256 or agents/high=4096")
    p.add_argument("--keep-reward", type=float, default=None, help="outcome stage: reward needed to keep (default 1.0)")
    t = p.add_argument_group("teacher (default: the family's reference solver)")
    t.add_argument("--teacher-url", help="OpenAI-compatible server root, e.g. http://127.0.0.1:8000")
    t.add_argument("--teacher-model", help="model name for --teacher-url")
    t.add_argument("--api-key-env", help="name of an environment variable holding the endpoint's API key")
    t.add_argument("--teacher-model-dir", help="a local model folder (XTML + transformers generate)")
    t.add_argument("--concurrency", type=int, default=8, help="endpoint requests in flight")
    t.add_argument("--retries", type=int, default=4, help="endpoint retries on 429 / 5xx / connection errors")
    t.add_argument("--backoff", type=float, default=0.5, help="first retry wait in seconds (doubles per retry)")
    t.add_argument("--temperature", type=float, default=None)
    t.add_argument("--max-tokens", type=int, default=None, help="max new tokens per turn")
    p.set_defaults(fn=cmd_synth)
    return p


def _families(names: list[str]) -> list[Any]:
    from k3post.envs.task import DOMAINS
    from k3post.synth.pipeline import builtin_families, find_family

    out: list[Any] = []
    for n in names:
        if n == "all":
            out += builtin_families()
        elif n in DOMAINS:
            out += builtin_families(n)
        else:
            try:
                out.append(find_family(n))
            except ValueError as e:  # the user's --family: a usage error (exit 2), not a failure
                raise UserError(f"--family: {e}") from None
    if not out:
        raise UserError(f"--family {','.join(names)}: no task family selected")
    seen: dict[str, Any] = {}
    for f in out:
        seen.setdefault(f.name, f)
    return list(seen.values())


def _api_key(env_name: str | None) -> str | None:
    """The API key held by environment variable ``env_name`` (None when no name is given)."""
    if not env_name:
        return None
    key = os.environ.get(env_name)
    if not key:
        raise UserError(f"--api-key-env {env_name}: that environment variable is not set")
    return key


def _teacher_factory(ns: argparse.Namespace) -> Any:
    from k3post.rollout.engine import SamplingParams
    from k3post.synth.teachers import EndpointTeacher, LocalModelTeacher, ReferenceTeacher

    if ns.teacher_url and ns.teacher_model_dir:
        raise UserError("give either --teacher-url (endpoint) or --teacher-model-dir (local model), not both")
    if ns.teacher_url:
        if not ns.teacher_model:
            raise UserError("--teacher-url needs --teacher-model (the model name the server serves)")
        key = _api_key(ns.api_key_env)
        teacher = EndpointTeacher(
            ns.teacher_url, ns.teacher_model, api_key=key, concurrency=ns.concurrency, retries=ns.retries,
            backoff_s=ns.backoff, temperature=ns.temperature, max_tokens=ns.max_tokens,
        )
        return lambda fam: teacher
    if ns.teacher_model_dir:
        sp = SamplingParams(
            max_tokens=ns.max_tokens or 512, temperature=1.0 if ns.temperature is None else ns.temperature, seed=ns.seed
        )
        local = LocalModelTeacher(ns.teacher_model_dir, sampling=sp)
        return lambda fam: local
    if ns.teacher_model:
        raise UserError("--teacher-model needs --teacher-url")
    return ReferenceTeacher


def cmd_synth(ns: argparse.Namespace) -> int:
    """Run ``k3post synth``; prints the funnel table."""
    from k3post.synth.pipeline import build_sft_dataset
    from k3post.synth.verify import VerifyConfig

    efforts = _split(ns.effort) or ["all"]
    if "all" in efforts:
        efforts = list(_EFFORTS)
    bad = [e for e in efforts if e not in _EFFORTS]
    if bad:
        raise UserError(f"--effort: unknown effort {bad[0]!r}; expected low, high, max or all")
    if ns.n < 1:
        raise UserError(f"--n must be a positive integer, got {ns.n}")
    budgets = _kv(ns.budget, "--budget", int)
    vc = VerifyConfig(budgets={**VerifyConfig().budgets, **budgets})
    if ns.keep_reward is not None:
        vc.keep_reward = ns.keep_reward
    tokenizer = None
    if ns.tokenizer:
        from k3post.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(ns.tokenizer, require_xtml=True)
    fams = _families(_split(ns.family))
    path, funnel = build_sft_dataset(
        fams, efforts, ns.n, ns.seed, ns.out, tokenizer, teacher=_teacher_factory(ns), difficulty=ns.difficulty,
        config=vc, review_dir=ns.review_dir,
    )
    print(funnel.table())
    review = ns.review_dir or str(Path(ns.out).with_name(Path(ns.out).stem + ".review"))
    print(f"wrote {path} ({funnel.final['keep']} kept); {funnel.final['uncertain']} to review in {review}")
    return 0


# --------------------------------------------------------------------------- review


# --------------------------------------------------------------------------- synth-tasks


def add_synth_tasks_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``k3post synth-tasks``: concept DAG → node combinations → evidence → tasks → verification funnel."""
    p = subparsers.add_parser("synth-tasks", help="KG-guided synthesis of verifiable search tasks over a local corpus")
    p.add_argument("--out", required=True, help="folder for kg_dag.json, kg_tasks.jsonl, kg_rejected.jsonl, kg_funnel.json")
    p.add_argument("--n", type=int, default=60, help="candidate tasks to synthesise (before the funnel)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", help="JSONL corpus, one {id, title, text} per line (default: a seeded built-in corpus)")
    p.add_argument("--seeds", action="append", help="seed concepts, comma-separated or repeated (default: the corpus's definition heads)")
    p.add_argument("--max-depth", type=int, default=4, help="deepest concept level grown")
    e = p.add_argument_group("explorer (default: the offline corpus explorer)")
    e.add_argument("--explorer-url", help="OpenAI-compatible server root, e.g. http://127.0.0.1:8000")
    e.add_argument("--explorer-model", help="model name for --explorer-url")
    e.add_argument("--api-key-env", help="name of an environment variable holding the endpoint's API key")
    p.set_defaults(fn=cmd_synth_tasks)
    return p


def cmd_synth_tasks(ns: argparse.Namespace) -> int:
    """Run ``k3post synth-tasks``; prints the DAG size and the funnel."""
    from k3post.synth.kg_tasks import EndpointExplorer, synth_tasks

    if ns.n < 1:
        raise UserError(f"--n must be a positive integer, got {ns.n}")
    if ns.corpus and not Path(ns.corpus).is_file():
        raise UserError(f"--corpus {ns.corpus}: file not found")
    explorer = None
    if ns.explorer_url:
        if not ns.explorer_model:
            raise UserError("--explorer-url needs --explorer-model (the model name the server serves)")
        explorer = EndpointExplorer(ns.explorer_url, ns.explorer_model, api_key=_api_key(ns.api_key_env))
    elif ns.explorer_model:
        raise UserError("--explorer-model needs --explorer-url")
    try:
        s = synth_tasks(ns.out, n=ns.n, seed=ns.seed, corpus=ns.corpus, seeds=_split(ns.seeds), explorer=explorer,
                        max_depth=ns.max_depth)
    except ValueError as e:
        raise UserError(str(e)) from None
    d = s["dag"]
    print(f"concept DAG: {d['nodes']} nodes ({d['atomic']} atomic, {d['seeds']} seeds), {d['edges']} edges, depth {d['max_depth']}; "
          f"proposals {d['proposed']}: {d['merged']} merged, {d['ungrounded']} ungrounded, {d['not_finer']} not finer")
    for st in s["funnel"]["stages"]:
        reasons = ", ".join(f"{k} {v}" for k, v in st["reject_reasons"].items())
        print(f"  {st['name']:<12} in {st['seen']:>4}  kept {st['kept']:>4}" + (f"  rejected: {reasons}" if reasons else ""))
    print(f"kept {s['kept']} of {s['funnel']['total']} tasks {s['kept_by_type']} → {Path(ns.out) / 'kg_tasks.jsonl'}")
    return 0


def add_review_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``k3post review list|show|accept|reject|edit|export``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--queue", default=os.environ.get("K3POST_REVIEW_QUEUE"), help="review queue folder (default $K3POST_REVIEW_QUEUE)")
    common.add_argument("--reviewer", default=None, help="your name in the decision log (default $K3POST_REVIEWER or the login name)")
    p = subparsers.add_parser("review", help="the human review queue of uncertain SFT samples")
    sub = p.add_subparsers(dest="review_cmd", required=True)
    ls = sub.add_parser("list", parents=[common], help="list queued samples")
    ls.add_argument("--status", choices=["pending", "accepted", "rejected", "all"], default="all")
    sh = sub.add_parser("show", parents=[common], help="show one sample, rendered")
    sh.add_argument("id")
    sh.add_argument("--plain", action="store_true", help="plain text even if rich is installed")
    for name, helptext in (("accept", "accept a sample for training"), ("reject", "reject a sample")):
        d = sub.add_parser(name, parents=[common], help=helptext)
        d.add_argument("id")
        d.add_argument("--note", required=(name == "reject"), default="", help="why (required for reject)")
        d.add_argument("--force", action="store_true", help="override an earlier decision (both stay in the log)")
    ed = sub.add_parser("edit", parents=[common], help="edit a sample's messages in $EDITOR, re-verify, accept")
    ed.add_argument("id")
    ed.add_argument("--note", default="")
    ed.add_argument("--force", action="store_true")
    ed.add_argument("--tokenizer", help="tokenizer folder for exact token counts and XTML checks")
    ex = sub.add_parser("export", parents=[common], help="write the accepted samples as SFT JSONL")
    ex.add_argument("out")
    p.set_defaults(fn=cmd_review)
    return p


def cmd_review(ns: argparse.Namespace) -> int:
    """Run ``k3post review ...``."""
    from k3post.synth.review import ReviewQueue, render_item_rich

    if not ns.queue:
        raise UserError("give the review queue folder with --queue DIR (or set $K3POST_REVIEW_QUEUE)")
    if not Path(ns.queue).is_dir():
        raise UserError(f"--queue {ns.queue}: no such review queue folder")
    q = ReviewQueue(ns.queue)
    cmd = ns.review_cmd
    if cmd == "list":
        items = q.items(None if ns.status == "all" else ns.status)
        if not items:
            print(f"no {'' if ns.status == 'all' else ns.status + ' '}items in {q.root}")
            return 0
        rows = [("id", "status", "family", "effort", "flag")]
        for it in items:
            f = (it.get("flags") or [{}])[0]
            rows.append((it["id"], it["status"], str(it["sample"].get("family")), str(it["sample"].get("effort")),
                         f"{f.get('stage', '')}: {f.get('reason', '')}"))
        w = [max(len(r[i]) for r in rows) for i in range(5)]
        for r in rows:
            print("  ".join(v.ljust(w[i]) for i, v in enumerate(r)).rstrip())
        counts = {s: sum(it["status"] == s for it in items) for s in ("pending", "accepted", "rejected")}
        print(f"{len(items)} items: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    elif cmd == "show":
        use_rich = not ns.plain and sys.stdout.isatty()
        if use_rich:
            try:
                render_item_rich(q.get(ns.id))
                return 0
            except ImportError:
                pass
        sys.stdout.write(q.render(ns.id, use_rich=False))
    elif cmd in ("accept", "reject"):
        d = q.decide(ns.id, cmd, reviewer=ns.reviewer, note=ns.note, force=ns.force)
        print(f"{d['id']}: {cmd}ed by {d['reviewer']} at {d['time']}")
    elif cmd == "edit":
        tok = None
        if ns.tokenizer:
            from k3post.tokenizer import load_tokenizer

            tok = load_tokenizer(ns.tokenizer, require_xtml=True)
        d = q.edit(ns.id, reviewer=ns.reviewer, note=ns.note, tokenizer=tok, force=ns.force)
        checks = ", ".join(f"{c['stage']} {c['status']}" for c in d["checks"])
        print(f"{d['id']}: edited and accepted by {d['reviewer']} at {d['time']} (re-verified: {checks})")
    elif cmd == "export":
        out = q.export(ns.out)
        print(f"wrote {len(q.accepted_samples())} accepted samples to {out}")
    return 0


# --------------------------------------------------------------------------- mix


def add_mix_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``k3post mix``: weighted domain / effort mixing of SFT JSONL files."""
    p = subparsers.add_parser("mix", help="mix SFT JSONL files by domain / effort with weights")
    p.add_argument("--config", help="YAML mix config (inputs, out, n, seed, weights); flags override it")
    p.add_argument("--in", dest="inputs", action="append", help="input JSONL (repeatable)")
    p.add_argument("--out", help="output JSONL")
    p.add_argument("--weight", action="append", metavar="KEY=W", help="weight of 'domain/effort', 'domain', '*/effort' or '*'")
    p.add_argument("--n", type=int, default=None, help="samples in the mix (default: as many as the inputs hold)")
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(fn=cmd_mix)
    return p


def cmd_mix(ns: argparse.Namespace) -> int:
    """Run ``k3post mix``."""
    from k3post.synth.mix import MixConfig, load_mix_config, mix_files

    cfg = load_mix_config(ns.config) if ns.config else MixConfig()
    inputs = ns.inputs or cfg.inputs
    out = ns.out or cfg.out
    if not inputs:
        raise UserError("mix: give input files with --in (or 'inputs' in --config)")
    if not out:
        raise UserError("mix: give the output file with --out (or 'out' in --config)")
    weights = {**cfg.weights, **_kv(ns.weight, "--weight", float)}
    n = ns.n if ns.n is not None else cfg.n
    path, counts = mix_files(inputs, out, weights, n or None, cfg.seed if ns.seed is None else ns.seed)
    print(f"wrote {sum(counts.values())} samples to {path}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0
