"""The `k3post` command.

    k3post demo [CONFIG] [key=value ...]        the whole pipeline on a tiny MoE (CPU)
    k3post pretrain CONFIG [key=value ...]      Stage 0: the pretrained base (cached by content hash) + copy probe
    k3post sft CONFIG [key=value ...]           Stage 1 SFT on a JSONL file (sft.train_file)
    k3post rl CONFIG [key=value ...]            Stage 2 RL: one expert (rl.domain at rl.effort) from rl.init
    k3post experts CONFIG [key=value ...]       Stage 2 RL: the nine domain x effort experts (max -> high -> low)
    k3post mopd CONFIG [key=value ...]          Stage 3 MOPD: distil the nine experts into one student
    k3post draft CONFIG [key=value ...]         EAGLE-3 draft for the target (MOPD student), LK loss, vLLM/SGLang export
    k3post init-model OUT_DIR [--preset tiny]   write a tiny Qwen3-MoE + BPE tokenizer that transformers loads
    k3post add-tokens MODEL_DIR OUT_DIR         a copy whose tokenizer has the XTML tokens, embeddings resized
    k3post export CKPT OUT [--format mxfp4|bf16] packed MXFP4 experts + bf16 rest, or all bf16
    k3post tasks list | sample FAMILY            the built-in task families
    k3post synth --family F --effort E --n N --out data.jsonl   SFT trajectories from a teacher, verified
    k3post synth-tasks --out DIR [--corpus docs.jsonl]   KG-guided search tasks (concept DAG → tasks → funnel)
    k3post review list|show|accept|reject|edit   the human review queue of flagged samples
    k3post mix ...                              mix datasets by domain / effort weights
    k3post serve MODEL_DIR [--port 8000]         OpenAI-compatible server (chat, completions, models)
    k3post report RUN_DIR                       rebuild a run's report.html
    k3post status RUN_DIR                       one screen: status, model, step / ETA per stage, checkpoints

Overrides are dotted config keys (`sft.lr=3e-4`); an unknown key is an error naming the closest valid one.
Exit status: 0 done; 2 invalid input (one line naming the key, file:line or path); 1 anything else (one
line, and the file holding the full traceback: the run folder's k3post.log, else a file in the temp folder).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _load(config: str | None, overrides: list[str]):  # noqa: ANN202
    from k3post.config import apply_sandbox_config, load_config
    from k3post.errors import user_input

    with user_input():  # the config's own checks (each component's __post_init__) validate the user's input
        cfg = load_config(config, overrides)
    apply_sandbox_config(cfg.sandbox)
    if cfg.data.search_tasks:  # agents.search draws from a synthesised set (k3post synth-tasks)
        from k3post.envs.families.agents.family import SEARCH

        with user_input():
            SEARCH.use_synth_tasks(cfg.data.search_tasks)
    return cfg


def _split_config(args: list[str]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _on_ranks(fn, cfg, command: str):  # noqa: ANN001, ANN202
    """``fn(cfg)`` in this process, or as rank 0 of ``distributed.fsdp.ranks`` trainer ranks."""
    from k3post.errors import UserError

    ranks = cfg.distributed.fsdp.ranks
    if ranks > 1 and command in ("demo", "draft"):
        raise UserError(f"distributed.fsdp.ranks={ranks}: k3post {command} trains no sharded model; use 1 rank")
    if ranks > 1 and command == "sft" and cfg.sft.mtp_weight > 0 and cfg.distributed.fsdp.strategy != "no_shard":
        raise UserError(f"sft.mtp_weight={cfg.sft.mtp_weight}: the MTP head is not supported with "
                        f"distributed.fsdp.ranks={ranks} and strategy=full_shard (set distributed.fsdp.strategy="
                        "no_shard, sft.mtp_weight=0 or distributed.fsdp.ranks=1)")
    from k3post.trainer.ranks import on_ranks

    d = cfg.distributed
    if not d.enabled or command in ("demo", "draft") or (command == "sft" and ranks == 1):
        return on_ranks(d.fsdp, fn, cfg)
    if command == "experts" and ranks > 1:
        raise UserError(f"distributed.fsdp.ranks={ranks}: k3post experts on Ray (distributed.enabled=true) trains each "
                        "expert in a Ray task of one process; use distributed.fsdp.ranks=1 (one expert per trainer "
                        "slot), or distributed.enabled=false to shard one expert at a time over the ranks")
    if ranks > d.roles.trainers:
        raise UserError(f"distributed.fsdp.ranks={ranks} needs a trainer slot per rank on Ray, but "
                        f"distributed.roles.trainers is {d.roles.trainers}; set distributed.roles.trainers={ranks}")
    if command in ("rl", "experts"):
        from k3post.recipes.commands import check_judge_slots

        check_judge_slots(cfg)  # before Ray starts
    from k3post.distributed.env_workers import remote_environments
    from k3post.distributed.ray_cluster import RayCluster, RayFollowers

    # one placement group for the whole command: trainer ranks > 0, engine servers, env workers, teachers, judges
    with RayCluster(d) as cluster, remote_environments(cluster, sandbox=cfg.sandbox):
        return on_ranks(d.fsdp, fn, cfg, followers=lambda: RayFollowers(cluster))


def _threaded(fn, cfg, command: str, *, ranks: bool = True):  # noqa: ANN001, ANN202
    """``fn`` run (on its ranks, `_on_ranks`) under the command's thread plan (`k3post.threads`): set before any
    process starts, recorded in the run's k3post.log and threads.json when the run folder opens."""
    from k3post.threads import command_plan, use_threads

    with use_threads(command_plan(cfg, command), f"k3post {command}"):
        return _on_ranks(fn, cfg, command) if ranks else fn(cfg)


def cmd_demo(ns: argparse.Namespace) -> int:
    from k3post.recipes.demo import run_demo

    config, overrides = _split_config(ns.args)
    if config is None and Path("configs/demo.yaml").exists():
        config = "configs/demo.yaml"
    _threaded(run_demo, _load(config, overrides), "demo")
    return 0


def cmd_sft(ns: argparse.Namespace) -> int:
    from k3post.recipes.commands import run_sft

    config, overrides = _split_config(ns.args)
    if config is None:
        raise ValueError("usage: k3post sft CONFIG [key=value ...]")
    _threaded(run_sft, _load(config, overrides), "sft")
    return 0


def cmd_pretrain(ns: argparse.Namespace) -> int:
    from k3post.stages.pretrain import run_pretrain

    config, overrides = _split_config(ns.args)
    if config is None:
        raise ValueError("usage: k3post pretrain CONFIG [key=value ...]")
    _threaded(run_pretrain, _load(config, overrides), "pretrain", ranks=False)
    return 0


def cmd_rl(ns: argparse.Namespace) -> int:
    from k3post.recipes.commands import run_experts, run_rl

    config, overrides = _split_config(ns.args)
    if config is None:
        raise ValueError(f"usage: k3post {ns.command} CONFIG [key=value ...]")
    from k3post.recipes.commands import run_draft, run_mopd

    fn = {"experts": run_experts, "rl": run_rl, "mopd": run_mopd, "draft": run_draft}[ns.command]
    _threaded(fn, _load(config, overrides), ns.command)
    return 0


def cmd_init_model(ns: argparse.Namespace) -> int:
    from k3post.recipes.commands import init_model

    out = init_model(ns.out_dir, preset=ns.preset, vocab_size=ns.vocab_size, seed=ns.seed)
    print(f"wrote {out}")
    return 0


def cmd_add_tokens(ns: argparse.Namespace) -> int:
    from k3post.recipes.commands import add_xtml_tokens

    out, added = add_xtml_tokens(ns.model_dir, ns.out_dir, seed=ns.seed)
    if out is None:
        print(f"{ns.model_dir}: the tokenizer already has the XTML tokens; nothing to add (use the folder as it is)")
    else:
        print(f"wrote {out}: added {', '.join(added)} (new embedding rows, untrained until SFT)")
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from k3post.quant.export import export_model

    out = export_model(ns.ckpt, ns.out, fmt=ns.format, rest_dtype=ns.rest_dtype)
    print(f"wrote {ns.format} export → {out}")
    return 0


def cmd_report(ns: argparse.Namespace) -> int:
    from k3post.recipes.report import write_report

    print(write_report(ns.run_dir))
    return 0


def cmd_status(ns: argparse.Namespace) -> int:
    from k3post.status import status_text

    print(status_text(ns.run_dir))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3post", description="Kimi K3 post-training pipeline")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the whole pipeline on a tiny MoE on CPU")
    d.add_argument("args", nargs="*", help="[CONFIG] [key=value ...]")
    d.set_defaults(fn=cmd_demo)
    pt = sub.add_parser("pretrain", help="Stage 0: pretrain the base on the generated corpus (cached) + copy probe")
    pt.add_argument("args", nargs="*", help="CONFIG [key=value ...]")
    pt.set_defaults(fn=cmd_pretrain)
    s = sub.add_parser("sft", help="Stage 1 SFT on XTML conversations (JSONL)")
    s.add_argument("args", nargs="*", help="CONFIG [key=value ...]")
    s.set_defaults(fn=cmd_sft)
    for name, help_ in (("rl", "Stage 2 RL: one expert (rl.domain at rl.effort) from rl.init"),
                        ("experts", "Stage 2 RL: the nine domain x effort experts, max -> high -> low"),
                        ("mopd", "Stage 3 MOPD: distil the experts into one student that follows the effort"),
                        ("draft", "Deployment: an EAGLE-3 draft for the frozen target, trained with the LK loss")):
        c = sub.add_parser(name, help=help_)
        c.add_argument("args", nargs="*", help="CONFIG [key=value ...]")
        c.set_defaults(fn=cmd_rl)
    i = sub.add_parser("init-model", help="write a tiny Qwen3-MoE + tokenizer folder")
    i.add_argument("out_dir")
    i.add_argument("--preset", default="tiny")
    i.add_argument("--vocab-size", type=int, default=512)
    i.add_argument("--seed", type=int, default=0)
    i.set_defaults(fn=cmd_init_model)
    a = sub.add_parser("add-tokens", help="copy a model folder, adding the XTML tokens and resizing its embeddings")
    a.add_argument("model_dir", help="a model folder (config.json, weights, tokenizer) or a tokenizer-only folder")
    a.add_argument("out_dir", help="a new folder for the copy")
    a.add_argument("--seed", type=int, default=0, help="seed of the new embedding rows")
    a.set_defaults(fn=cmd_add_tokens)
    e = sub.add_parser("export", help="export a checkpoint: MXFP4 experts (gpt-oss layout) + bf16, or bf16")
    e.add_argument("ckpt")
    e.add_argument("out")
    e.add_argument("--format", choices=["mxfp4", "bf16"], default="mxfp4")
    e.add_argument("--rest-dtype", default="bfloat16", help="dtype of non-expert weights in an mxfp4 export")
    e.set_defaults(fn=cmd_export)
    from k3post.envs.families.cli import add_tasks_parser

    add_tasks_parser(sub)
    from k3post.synth.cli import add_mix_parser, add_review_parser, add_synth_parser, add_synth_tasks_parser

    add_synth_parser(sub)
    add_synth_tasks_parser(sub)
    add_review_parser(sub)
    add_mix_parser(sub)
    from k3post.serve.cli import add_serve_parser

    add_serve_parser(sub)
    r = sub.add_parser("report", help="rebuild report.html of a run folder")
    r.add_argument("run_dir")
    r.set_defaults(fn=cmd_report)
    st = sub.add_parser("status", help="one screen on a run folder: status, steps and ETA, last metrics, checkpoints")
    st.add_argument("run_dir")
    st.set_defaults(fn=cmd_status)
    return p


def main(argv: list[str] | None = None) -> int:
    from k3post.errors import UserError, detach_run_log, write_traceback
    from k3post.threads import quiet_waits

    quiet_waits()  # before anything loads torch's OpenMP runtime (k3post.threads)
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if ns.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return ns.fn(ns)
    except UserError as e:  # input the user can fix: one clear line, no traceback (-v shows it)
        if ns.verbose:
            raise
        print(f"k3post: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - not the user's input: say so, and where the traceback is
        try:
            where = f"the full traceback is in {write_traceback(e, sys.argv[1:] if argv is None else argv)}"
        except OSError as e2:  # a full disk fails the traceback file too: the one line must still come out
            where = f"the traceback could not be written ({e2.strerror or e2}); rerun with -v to see it"
        if ns.verbose:
            raise
        print(f"k3post: failed: {type(e).__name__}: {e}\n"
              f"k3post: this is not an input error; {where}", file=sys.stderr)
        return 1
    finally:
        detach_run_log()
        from k3post.runs import release_runs

        release_runs()


if __name__ == "__main__":
    raise SystemExit(main())
