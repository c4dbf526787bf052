"""``k3post serve MODEL_DIR``: the OpenAI-compatible server on uvicorn.

`k3post.cli` wires it in with::

    from k3post.serve.cli import add_serve_parser
    add_serve_parser(sub)

    k3post serve runs/demo/sft/final                       # http://127.0.0.1:8000/v1
    k3post serve runs/demo/sft/final --port 8001 --model-name k3-tiny --max-batch-size 64 --no-qat

FastAPI and uvicorn are imported when the command runs, so building the CLI parser stays
light. User errors are ValueErrors (printed as one line by `k3post.cli.main`).

Shape legend: none (no tensors here).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3post.constants import DEFAULT_EFFORT
from k3post.errors import UserError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from k3post.serve.server import ServeLimits

__all__ = ["add_serve_parser", "build_server", "serve", "cmd_serve", "check_exposure", "is_loopback"]

_EFFORT_CHOICES = ("low", "high", "max", "none")  # k3post.serve.server.EFFORT_CHOICES, without importing it


def build_server(
    model_dir: str | Path,
    *,
    model_name: str | None = None,
    max_batch_size: int = 32,
    max_model_len: int | None = None,
    qat: bool = True,
    seed: int = 0,
    default_effort: str = DEFAULT_EFFORT,
    default_max_tokens: int | None = 1024,
    api_key: str | None = None,
    limits: "ServeLimits | None" = None,
    torch_threads: int | None = None,
    draft: str | None = None,
    num_draft_tokens: int = 4,
    record_routes: bool = False,
    exact: bool = False,
) -> "FastAPI":
    """Load ``model_dir`` (model + tokenizer) into an `EmbeddedEngine` and return the app.

    Args:
        model_dir: a folder written by ``save_model`` / ``k3post init-model`` (config,
            safetensors and the XTML tokenizer).
        model_name: id served by ``/v1/models`` (default: the folder name).
        max_batch_size: engine slots, i.e. most requests decoded together.
        max_model_len: most positions per sequence (default: the model config's).
        qat: run the routed experts with MX fake quantization (MXFP4 weights, MXFP8
            activations), as in QAT training and RL rollouts (SPEC §5, §6.1).
        seed: engine seed (requests without ``seed``).
        default_effort: ``thinking_effort`` of requests that give none.
        default_max_tokens: output cap of requests without ``max_tokens`` (None: the room left).
        api_key: require ``Authorization: Bearer <api_key>`` on every route but ``/health``.
        limits: request bounds (`k3post.serve.server.ServeLimits`; None: its safe defaults).
        torch_threads: torch CPU threads of the engine thread (None: torch's default).
        draft: speculative decoding with this draft folder (an EAGLE-3 export of ``k3post draft`` or a small
            causal LM; `k3post.config.rollout.EngineConfig.draft`), ``num_draft_tokens`` a round; None: off.
        record_routes: the engine records the experts every position was routed to; ``/generate`` returns them
            in ``meta_info.routes`` (routing replay, `k3post.routing_replay`).
        exact: the engine runs the exact forward (`k3post.rollout.embedded.exact`): its log-probs equal a trainer's
            exact recomputation (``rl.rollout.exact``) bit for bit, whatever batches the server forms.
    """
    from k3post.config.rollout import EngineConfig
    from k3post.quant.qat import QATConfig
    from k3post.rollout.factory import build_engine
    from k3post.serve.app import create_app
    from k3post.serve.server import ServeConfig, ServeLimits
    from k3post.serve.runner import EngineRunner
    from k3post.tokenizer import load_tokenizer

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: not a model folder (no config.json)")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise UserError(f"{path}: no tokenizer in the model folder")
    config = ServeConfig(
        model_name=model_name or path.resolve().name, default_effort=default_effort,
        default_max_tokens=default_max_tokens, api_key=api_key, model_path=str(path.resolve()),
        limits=limits or ServeLimits(),
    )
    tokenizer = load_tokenizer(path, require_xtml=True)
    engine = build_engine(
        path, tokenizer, engine=EngineConfig(draft=draft or "", num_draft_tokens=num_draft_tokens),
        max_batch_size=max_batch_size, max_model_len=max_model_len, qat=QATConfig() if qat else None, seed=seed,
        **({"record_routes": True} if record_routes else {}), **({"exact": True} if exact else {}),
    )
    return create_app(EngineRunner(engine, torch_threads=torch_threads), tokenizer, config)


def serve(app: "FastAPI", *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run ``app`` on uvicorn until interrupted (one worker: the engine lives in this process)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, workers=1)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server reachable from this machine only (``localhost``, 127.0.0.0/8,
    ``::1``); a name other than ``localhost`` counts as reachable from elsewhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """Refuse (UserError, exit 2) to serve the engine API without a key on a host other machines reach,
    unless the user says so; warn when they do."""
    if api_key or is_loopback(host):
        return
    if not allow_unauthenticated:
        raise UserError(
            f"--host {host} is reachable from other machines and no API key is set: anyone who can reach the port "
            "could pause the engine, replace its weights from any path the server can read, make it connect to any "
            "host:port (/init_weights_update_group) and read its weights. Set --api-key (or K3POST_API_KEY), or pass "
            "--allow-unauthenticated-engine-api to serve without one (README, Security)")
    print(f"k3post serve: WARNING: --host {host} without an API key (--allow-unauthenticated-engine-api): every "
          "route, the engine API included, is open to anyone who can reach the port", file=sys.stderr)


def cmd_serve(ns: argparse.Namespace) -> int:
    """Body of ``k3post serve``."""
    if not (0 <= ns.port <= 65535):
        raise UserError(f"--port must be in [0, 65535], got {ns.port}")
    api_key = ns.api_key or os.environ.get("K3POST_API_KEY") or None
    check_exposure(ns.host, api_key, ns.allow_unauthenticated_engine_api)
    if ns.threads < 0:
        raise UserError(f"--threads must be >= 0 (0: chosen from the cores, k3post.threads), got {ns.threads}")
    from k3post.threads import PARENT_ENV, exit_with_parent, plan_threads, seen_cores

    if os.environ.get(PARENT_ENV, "").isdigit():  # launched by a k3post command: exit when it is killed
        exit_with_parent(parent=int(os.environ[PARENT_ENV]))

    plan = plan_threads(seen_cores(), {"server": 1}, ns.threads, key="--threads")
    for w in plan.warnings:
        print(f"k3post serve: WARNING: {w}", file=sys.stderr)
    print(f"k3post serve: {plan.describe()}", file=sys.stderr)
    from k3post.serve.server import ServeLimits

    try:
        limits = ServeLimits.parse(ns.limit)
    except ValueError as e:
        raise UserError(str(e)) from None
    app = build_server(
        ns.model_dir, model_name=ns.model_name, max_batch_size=ns.max_batch_size, max_model_len=ns.max_model_len,
        qat=ns.qat, seed=ns.seed, default_effort=ns.thinking_effort, default_max_tokens=ns.default_max_tokens or None,
        api_key=api_key, torch_threads=plan.per_process,
        draft=ns.draft, num_draft_tokens=ns.num_draft_tokens, limits=limits, record_routes=ns.record_routes,
        exact=ns.exact,
    )
    print(f"serving {app.state.server.config.model_name} on http://{ns.host}:{ns.port}/v1")
    serve(app, host=ns.host, port=ns.port, log_level=ns.log_level)
    return 0


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``k3post serve MODEL_DIR``: an OpenAI-compatible server (chat, completions, models)."""
    p = subparsers.add_parser(
        "serve", help="serve a model folder over an OpenAI-compatible HTTP API (continuous batching)",
        description="OpenAI-compatible server: /v1/chat/completions (XTML tools, tool_calls, reasoning_content, "
                    "thinking_effort, streaming), /v1/completions, /v1/models, /health; the engine protocol "
                    "(SGLang names): /generate, /abort_request, /pause_generation, /continue_generation, "
                    "/update_weights_from_disk, /init_weights_update_group, /update_weights_from_distributed, "
                    "/destroy_weights_update_group, /get_weights_by_name, /flush_cache, /get_model_info, "
                    "/get_weight_version.",
    )
    p.add_argument("model_dir", help="model folder (config + safetensors + XTML tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="model id served and expected in requests (default: folder name)")
    p.add_argument("--max-batch-size", type=int, default=32, help="most requests decoded together")
    p.add_argument("--max-model-len", type=int, default=None, help="most positions per sequence (default: model config)")
    p.add_argument("--qat", action=argparse.BooleanOptionalAction, default=True,
                   help="MX fake-quantized experts as in QAT training / rollouts (default on)")
    p.add_argument("--seed", type=int, default=0, help="engine seed for requests without a seed")
    p.add_argument("--thinking-effort", choices=_EFFORT_CHOICES, default=DEFAULT_EFFORT,
                   help="effort of requests that give none ('none' = instruct mode)")
    p.add_argument("--draft", default=None, help="speculative decoding with this draft folder (an EAGLE-3 export "
                   "of `k3post draft`, or a small causal LM sharing the tokenizer)")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="tokens drafted per round with --draft")
    p.add_argument("--default-max-tokens", type=int, default=1024,
                   help="output cap for requests without max_tokens (default 1024; 0: the room left in the context)")
    p.add_argument("--limit", action="append", default=[], metavar="KEY=VALUE",
                   help="a request bound (repeatable): max_body_bytes, max_prompts, max_n, max_tokens, max_inflight, "
                        "request_timeout_s, echo_batch_tokens, retry_after_s, max_prompt_chars, max_json_depth, "
                        "max_weight_values, max_drain_bytes (k3post.serve.server.ServeLimits)")
    p.add_argument("--api-key", default=None, help="require this Bearer key on every route but /health: the OpenAI "
                   "API and the engine API (or set K3POST_API_KEY; engine.kind=http clients send it)")
    p.add_argument("--allow-unauthenticated-engine-api", action="store_true",
                   help="serve on a non-loopback --host without an API key (refused otherwise, exit 2): anyone who "
                        "reaches the port can then pause the engine and load weights (README, Security)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads of the engine thread (0: the cores this process may use, k3post.threads)")
    p.add_argument("--record-routes", action="store_true",
                   help="record the experts every position was routed to and return them in /generate's "
                        "meta_info.routes (routing replay: rl.rollout.routing_replay over engine.kind http)")
    p.add_argument("--exact", action="store_true",
                   help="the batch-invariant exact forward: log-probs equal a trainer's exact recomputation bit for "
                        "bit (rl.rollout.exact over engine.kind http; fails at start where this machine's kernels are not "
                        "batch-invariant)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(fn=cmd_serve)
    return p
