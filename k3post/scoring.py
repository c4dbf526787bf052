"""The model's log-probs of given tokens, batched: the trainer's forward (`token_logprobs`, and
`shared_prefix_logprobs` where the K samples of a group share their prompt), and `sequence_logprobs`, the prefill-only
scorer of MOPD teachers, the engine's ``score`` and the server's ``echo`` (`micro_batches` plans its batches).

Shared prompts. The K samples of a group share their prompt (every token before the first sampled one). The prompt
runs through the model once (batch 1) and its KV cache is broadcast to the K rows, which run only their own tokens:

    prefix  = model(ids[:P])                      one row, use_cache
    rest    = model(ids[:, P:], cache = prefix's KV expanded to K rows, positions P..)
    logp    = log_softmax([prefix logits at P−1, rest logits])[ids[:, P:]]

Gradients flow through the broadcast cache into the prefix forward, so log-probs and gradients equal the full
forward's up to fp32 summation order (tested: 1e-6 / 1e-5).

Shape legend: B sequences, T positions (right-padded), V vocabulary.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from collections.abc import Callable, Sequence
from typing import Any

import torch

from k3post.routing_replay import RouteReplay

__all__ = ["micro_batches", "sequence_logprobs", "shared_prefix_logprobs", "token_logprobs"]


def token_logprobs(
    model: torch.nn.Module,
    ids_BT: torch.Tensor,
    attn_BT: torch.Tensor,
    *,
    with_entropy: bool = False,
    entropy_mask_BT: torch.Tensor | None = None,
    replay: RouteReplay | None = None,
    routes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logp_BT[:, t] = log p(ids[:, t] | ids[:, <t])`` for t ≥ 1 and 0 at t = 0 (float32, with
    autograd when enabled), and the entropy of the predictive distribution at each position (detached;
    with ``entropy_mask_BT`` only at its positions, 0 elsewhere: the trainer needs it at sampled tokens
    only, and the full [B, T, V] softmax is the largest piece of work after the forward). ``replay``: the
    forward runs under `RouteReplay.replaying` of ``routes`` (recorded routes [B, T, M, K], -1 where unknown, and
    [B, T] True where recorded under the trained weights)."""
    with _replaying(replay, routes):
        logits_BTV = model(input_ids=ids_BT, attention_mask=attn_BT, use_cache=False).logits.float()
    logsm_BTV = torch.log_softmax(logits_BTV[:, :-1], dim=-1)
    lp_BT = logsm_BTV.gather(-1, ids_BT[:, 1:, None]).squeeze(-1)
    zero_B1 = lp_BT.new_zeros(ids_BT.shape[0], 1)
    logp_BT = torch.cat([zero_B1, lp_BT], dim=1)
    entropy_BT = None
    if with_entropy or entropy_mask_BT is not None:
        with torch.no_grad():
            if entropy_mask_BT is None:
                ent_BT = -(logsm_BTV.exp() * logsm_BTV).sum(-1)
            else:
                m_BT = entropy_mask_BT[:, 1:].bool()
                sel_NV = logsm_BTV[m_BT]
                ent_BT = lp_BT.new_zeros(lp_BT.shape).masked_scatter_(m_BT, -(sel_NV.exp() * sel_NV).sum(-1))
            entropy_BT = torch.cat([zero_B1, ent_BT], dim=1)
    return logp_BT, entropy_BT


def _replaying(replay: RouteReplay | None, routes: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
    """`RouteReplay.replaying` of (routes [B, T, M, K], recorded under the trained weights [B, T]) flattened as
    the model flattens its rows (a no-op without ``replay``)."""
    if replay is None:
        return nullcontext()
    if routes is None:
        return replay.replaying(None)
    routes_BTMK, fresh_BT = routes
    return replay.replaying(routes_BTMK.reshape(-1, *routes_BTMK.shape[2:]), fresh_BT.reshape(-1))


def _cache_kwarg(model: torch.nn.Module) -> str | None:
    """The name of the forward's KV-cache argument ("cache" in transformers ≥ 5.x, "past_key_values"
    before), or None when it has neither."""
    params = inspect.signature(model.forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def _broadcast_cache(cache: Any, rows: int) -> bool:
    """Expand a batch-1 KV cache to ``rows`` rows in place (views; autograd flows back to the one row).
    False when the cache is not a list of layers holding ``keys`` / ``values`` tensors."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(isinstance(getattr(layer, "keys", None), torch.Tensor)
                             and isinstance(getattr(layer, "values", None), torch.Tensor) for layer in layers):
        return False
    for layer in layers:
        layer.keys = layer.keys.expand(rows, *layer.keys.shape[1:])
        layer.values = layer.values.expand(rows, *layer.values.shape[1:])
    return True


def shared_prefix_logprobs(
    model: torch.nn.Module,
    ids_BT: torch.Tensor,
    attn_BT: torch.Tensor,
    prefix_len: int,
    *,
    entropy_mask_BT: torch.Tensor | None = None,
    replay: RouteReplay | None = None,
    routes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`token_logprobs` for B rows that share ``ids_BT[:, :prefix_len]`` (all attended): the prefix runs
    once and its KV cache is broadcast to the rows (module doc). Positions 1 .. prefix_len − 1 get 0 (they
    belong to the prompt and carry no loss). None when the model's cache cannot be broadcast. ``replay`` /
    ``routes``: as in `token_logprobs` (the prefix replays row 0's routes)."""
    B, T = ids_BT.shape
    P = prefix_len
    kw = _cache_kwarg(model)
    if kw is None or not 1 <= P < T:
        return None
    routes_pre = routes_rest = None
    if routes is not None:
        routes_pre, routes_rest = (routes[0][:1, :P], routes[1][:1, :P]), (routes[0][:, P:], routes[1][:, P:])
    with _replaying(replay, routes_pre):
        pre = model(input_ids=ids_BT[:1, :P], use_cache=True)
    cache = getattr(pre, kw, None)
    if cache is None or not _broadcast_cache(cache, B):
        return None
    pos_BS = torch.arange(P, T, device=ids_BT.device)[None].expand(B, -1)
    with _replaying(replay, routes_rest):
        rest = model(input_ids=ids_BT[:, P:], attention_mask=attn_BT, position_ids=pos_BS, use_cache=True,
                     **{kw: cache})
    logits_BSV = torch.cat([pre.logits[:, -1:].expand(B, -1, -1), rest.logits[:, :-1]], dim=1).float()
    logsm_BSV = torch.log_softmax(logits_BSV, dim=-1)
    tgt_BS = ids_BT[:, P:]
    lp_BS = logsm_BSV.gather(-1, tgt_BS[..., None]).squeeze(-1)
    logp_BT = torch.cat([lp_BS.new_zeros(B, P), lp_BS], dim=1)
    entropy_BT = None
    if entropy_mask_BT is not None:
        with torch.no_grad():
            m_BS = entropy_mask_BT[:, P:].bool()
            sel_NV = logsm_BSV[m_BS]
            ent_BS = lp_BS.new_zeros(lp_BS.shape).masked_scatter_(m_BS, -(sel_NV.exp() * sel_NV).sum(-1))
            entropy_BT = torch.cat([lp_BS.new_zeros(B, P), ent_BS], dim=1)
    return logp_BT, entropy_BT


def sequence_logprobs(model: torch.nn.Module, ids: Sequence[Sequence[int]], batch_tokens: int, *,
                      forward: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[list[float]]:
    """Per sequence, ``out[b][t] = log p(ids[b][t] | ids[b][:t])`` for t ≥ 1 (``out[b][0] = 0``): prefill
    only, under ``torch.inference_mode``, sequences batched by `micro_batches` (``batch_tokens`` padded
    tokens, right padding), float32. The scorer of MOPD teachers and of the server's ``echo``. ``forward``: the
    log-probs [B, T] of right-padded ids [B, T] (default: `token_logprobs` over the model's own forward; the
    exact engine passes the exact forward's)."""
    out: list[list[float]] = [[] for _ in ids]
    device = next(model.parameters()).device
    for idx in micro_batches([len(s) for s in ids], batch_tokens):
        T = max(len(ids[i]) for i in idx)
        ids_BT = torch.zeros(len(idx), T, dtype=torch.long)
        attn_BT = torch.zeros(len(idx), T, dtype=torch.long)
        for row, i in enumerate(idx):
            ids_BT[row, : len(ids[i])] = torch.tensor(list(ids[i]), dtype=torch.long)
            attn_BT[row, : len(ids[i])] = 1
        with torch.inference_mode():
            if forward is not None:
                logp_BT = forward(ids_BT.to(device))
            else:
                logp_BT, _ = token_logprobs(model, ids_BT.to(device), attn_BT.to(device))
        for row, i in enumerate(idx):
            out[i] = logp_BT[row, : len(ids[i])].tolist()
    return out


def micro_batches(lengths: Sequence[int], micro_batch_tokens: int) -> list[list[int]]:
    """Indices grouped longest first so that (rows × longest row) ≤ ``micro_batch_tokens``; a
    sequence longer than the budget gets a micro-batch of its own."""
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= micro_batch_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out
