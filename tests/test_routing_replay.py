"""Routing replay (issue 35, `k3post.routing_replay`): the engine records the experts every position went to, the
records move with the KV, and the trainer's forward replayed on them equals the engine's where routing disagrees.

Shape legend: T positions, M MoE layers, K experts per token.
"""

from __future__ import annotations

import copy

import pytest
import torch

from k3post.models import build_tiny_moe
from k3post.policy_step import TokenSequence, policy_grads
from k3post.quant.qat import QATConfig, apply_qat
from k3post.rollout import EmbeddedEngine, SamplingParams
from k3post.rollout.engine import GenerationRequest, GenerationResult
from k3post.rollout.trajectory import Trajectory
from k3post.routing_replay import RouteReplay, decode_routes, encode_routes, moe_routers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 300
# A position's routes are checked against the trainer's own top-k. The engine's forward and the trainer's differ in
# the last bits of the router logits (other GEMM shapes; ~1e-7 relative in fp32), so a top-k pair closer than that
# may flip: rare on a random model (0 of ~230 positions here). Routes written at the wrong position, or left over
# from another sequence in the slot, disagree on about half the positions and layers (tested below).
MAX_MISMATCH = 0.05


def _model(seed: int = 0) -> torch.nn.Module:
    return build_tiny_moe(V, seed=seed, pad_token_id=0, eos_token_id=1).eval()


def _requests(n: int, *, shared: int = 0, seed: int = 0, max_tokens: int = 12) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(5, V, (shared,), generator=g).tolist()
    return [GenerationRequest(f"r{i}", head + torch.randint(5, V, (6 + 3 * i,), generator=g).tolist(),
                              SamplingParams(max_tokens=max_tokens + i, seed=i, stop_ids=())) for i in range(n)]


def _own_mismatch(model: torch.nn.Module, results: list[GenerationResult]) -> tuple[int, int]:
    """(positions with a record, positions the model's own full forward routes differently in some layer)."""
    rp = RouteReplay(model)
    try:
        for r in results:
            ids = r.prompt_ids + r.output_ids
            assert r.routes is not None
            R = torch.full((len(ids),) + tuple(r.routes.shape[1:]), -1, dtype=torch.long)
            R[: len(r.routes)] = r.routes.long()
            with torch.no_grad(), rp.replaying(R):
                model(torch.tensor([ids]))
    finally:
        rp.remove()
    return rp.known, rp.mismatched


def _check(model: torch.nn.Module, results: list[GenerationResult]) -> None:
    M = len(moe_routers(model))
    for r in results:
        n = len(r.prompt_ids) + len(r.output_ids) - 1  # every fed position: all but the last sampled token
        assert r.routes is not None and tuple(r.routes.shape) == (n, M, 2), r.request_id
        assert bool((r.routes >= 0).all()), f"{r.request_id}: a fed position has no record"
    known, bad = _own_mismatch(model, results)
    assert known == sum(len(r.routes) for r in results)  # type: ignore[arg-type]
    assert bad <= MAX_MISMATCH * known, (bad, known)


def test_encoding_round_trip_and_errors():
    r = torch.randint(-1, 8, (7, 4, 2), dtype=torch.int16)
    text = encode_routes(r)
    assert text.startswith("7x4x2:") and torch.equal(decode_routes(text), r)
    assert decode_routes(encode_routes(r[:0])).shape == (0, 4, 2)
    for bad in ("7x4x2", "7x4:AAAA", "3x1x1:AAAAAA==", "1x1x1:!!"):
        with pytest.raises(ValueError, match="where-it-was"):
            decode_routes(bad, "where-it-was")


@pytest.mark.parametrize("path", ["lean", "general"])
def test_engine_records_each_position_s_experts(path):
    """Both forward paths, prefill (module router) and decode (the lean dense MoE routes itself), prefix sharing
    (a shared header and identical prompts), and slot moves when requests finish at different times."""
    model = _model()
    eng = EmbeddedEngine(model, max_batch_size=4, max_model_len=128, record_routes=True, path=path, min_shared_prefix=4)
    reqs = _requests(6, shared=8)
    reqs.append(GenerationRequest("twin", list(reqs[0].prompt_ids), SamplingParams(max_tokens=9, seed=99, stop_ids=())))
    res = eng.generate(reqs)
    assert eng.stats["shared_prefix_tokens"] + eng.stats["shared_prefills"] > 0
    _check(model, res)
    plain = EmbeddedEngine(model, max_batch_size=4, max_model_len=128, path=path)
    assert all(r.routes is None for r in plain.generate(_requests(2)))


def test_routes_follow_the_kv_through_pause_export_and_kept_turns():
    model = _model()
    eng = EmbeddedEngine(model, max_batch_size=2, max_model_len=160, record_routes=True)
    reqs = _requests(3, max_tokens=20)
    for r in reqs:
        eng.add_request(r)
    for _ in range(5):
        eng.step()
    partial = {p.request_id: p for p in eng.pause(["r0", "r1"])}
    assert partial["r0"].routes is not None and len(partial["r0"].routes) == len(reqs[0].prompt_ids) + 5 - 1
    kv = eng.export_kv("r0")
    assert kv.routes is not None and torch.equal(kv.routes, partial["r0"].routes)
    while eng.has_unfinished():  # r2 runs in the freed slots; its routes overwrite theirs
        eng.step()
    eng.add_request(GenerationRequest.continuation(partial["r0"], reqs[0].sampling), kv=kv)
    eng.resume(["r1"])
    done = {}
    while eng.has_unfinished():
        done.update({r.request_id: r for r in eng.step()})
    assert torch.equal(done["r0"].routes[: len(kv.routes)], kv.routes)  # type: ignore[index]
    _check(model, list(done.values()))
    # a kept multi-turn KV brings its routes into the next turn
    first = eng.generate([GenerationRequest("t0", reqs[2].prompt_ids, SamplingParams(max_tokens=6, seed=1, stop_ids=()),
                                            keep_kv=True)])[0]
    assert first.finish_reason == "length" and eng.take_kv("t0") is None  # kept on "stop" only
    stop = first.output_ids[2]
    turn1 = eng.generate([GenerationRequest("t1", reqs[2].prompt_ids, SamplingParams(max_tokens=6, seed=1,
                                                                                    stop_ids=(stop,)), keep_kv=True)])[0]
    kept = eng.take_kv("t1")
    assert kept is not None and kept.routes is not None and torch.equal(kept.routes, turn1.routes)
    ctx = turn1.prompt_ids + turn1.output_ids + [7, 8, 9]
    eng.add_request(GenerationRequest("t2", ctx, SamplingParams(max_tokens=5, seed=2, stop_ids=())), kv=kept)
    out: list[GenerationResult] = []
    while eng.has_unfinished():
        out += eng.step()
    turn2 = out[0]
    assert torch.equal(turn2.routes[: len(kept.routes)], kept.routes)
    _check(model, [turn2])


def test_router_that_replay_cannot_drive_fails_closed():
    model = _model()

    class Odd(torch.nn.Module):  # runs like a top-k router but says nothing of its k (a grouped router, say)
        def __init__(self, gate):
            super().__init__()
            self.weight, self.k = gate.weight, gate.top_k

        def forward(self, h):
            logits = h @ self.weight.t()
            p, e = torch.topk(torch.softmax(logits, -1), self.k, -1)
            return logits, p / p.sum(-1, keepdim=True), e

    model.model.layers[1].mlp.gate = Odd(model.model.layers[1].mlp.gate)
    with pytest.raises(ValueError, match="layer 1's router"):
        RouteReplay(model)
    with pytest.raises(ValueError, match="layer 1's router"):
        EmbeddedEngine(model, max_batch_size=2, max_model_len=64, record_routes=True, path="general")


def _seqs(results: list[GenerationResult], routes: bool) -> list[TokenSequence]:
    out = []
    for r in results:
        P = len(r.prompt_ids)
        mask = [False] * P + [True] * len(r.output_ids)
        out.append(TokenSequence(r.prompt_ids + r.output_ids, mask, [0.0] * P + r.output_logprobs,
                                 [0.5 if m else 0.0 for m in mask], [-1] * P + r.output_versions,
                                 routes=r.routes if routes else None))
    return out


def _grads(model: torch.nn.Module, seqs: list[TokenSequence], prefix: int, replay: bool) -> tuple[dict, torch.Tensor]:
    model.zero_grad()
    sums = policy_grads(model.train(), [(seqs, prefix)], pad_id=0, token_normalizer=100.0, version=0,
                        routing_replay=replay)
    model.eval()
    return sums, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("qat", [False, True])
def test_replaying_the_model_s_own_routes_changes_nothing(qat):
    """Where the records equal the trainer's own routing, the loss and every gradient are bit for bit those of a
    forward without replay (full forward and the shared-prompt forward): R3 costs nothing where nothing differs."""
    model = _model()
    if qat:
        apply_qat(model, QATConfig())
    eng = EmbeddedEngine(model, max_batch_size=8, max_model_len=128, record_routes=True)
    prompt = _requests(1, shared=20)[0].prompt_ids
    res = eng.generate([GenerationRequest(f"s{i}", prompt, SamplingParams(max_tokens=8 + 3 * i, seed=i, stop_ids=()))
                        for i in range(6)])
    for prefix in (0, len(prompt)):
        ref_sums, ref_g = _grads(model, _seqs(res, routes=False), prefix, replay=False)
        for replay in (False, True):
            sums, g = _grads(model, _seqs(res, routes=True), prefix, replay=replay)
            if sums["routes_mismatched"]:  # a last-bit flip between engine and trainer: not this test's case
                pytest.skip(f"{sums['routes_mismatched']} positions route differently on this CPU")
            assert sums["routes_known"] > 0
            assert sums["loss"] == ref_sums["loss"] and torch.equal(g, ref_g), (prefix, replay)


def test_replay_removes_the_gap_of_routes_that_flip():
    """A case built to disagree: in every MoE layer experts 0 and 1 have router rows w0 ± δu (the trainer w0 + δu,
    the engine w0 − δu, δ = 1e-6), so wherever the pair competes for a top-k place the two sides pick different
    experts, whose weights differ. Without replay the trainer's log-probs of those tokens are far from the
    engine's; replayed, the trainer routes as the engine did and its gating weights differ by the pair's logit gap,
    |Δ| ≤ 2δ|h| ≈ 3e-5 (|h| ≈ √D ≈ 11 after the RMSNorm), so the gap falls to the engine's fp32 noise."""
    trainer = build_tiny_moe(V, seed=0, pad_token_id=0, eos_token_id=1)
    u = torch.nn.functional.normalize(torch.randn(trainer.config.hidden_size, generator=torch.Generator().manual_seed(1)),
                                      dim=0)
    engine_model = copy.deepcopy(trainer)
    with torch.no_grad():
        for lt, le in zip(trainer.model.layers, engine_model.model.layers):
            w0 = lt.mlp.gate.weight[0].clone()
            lt.mlp.gate.weight[1] = w0 + 1e-6 * u
            le.mlp.gate.weight[1] = w0 - 1e-6 * u
    eng = EmbeddedEngine(engine_model.eval(), max_batch_size=8, max_model_len=128, record_routes=True)
    res = eng.generate(_requests(8, max_tokens=24))
    off, _ = _grads(trainer, _seqs(res, routes=True), 0, replay=False)
    on, _ = _grads(trainer, _seqs(res, routes=True), 0, replay=True)
    assert off["routes_mismatched"] > 0.2 * off["routes_known"]
    assert off["max/gap"] > 1e-2 and off["gap_sum"] / off["gap_n"] > 1e-3, off
    assert on["max/gap"] < 1e-4 and on["gap_sum"] / on["gap_n"] < 1e-5, on


def test_trajectory_keeps_the_latest_routes():
    t = Trajectory("t", 0, 0, 0, {"id": "x"})
    t.append([5, 6, 7, 8])
    r = torch.randint(0, 8, (3, 4, 2), dtype=torch.int16)
    t.set_routes(r)
    back = Trajectory.from_dict(t.to_dict())
    assert torch.equal(back.routes_tensor(), r)
    t.segment_start = 2
    t.truncate_segment()
    assert torch.equal(t.routes_tensor(), r[:2])
    with pytest.raises(ValueError, match="routes of 3 positions for a context of 2 tokens"):
        t.set_routes(r)
    assert Trajectory("u", 0, 0, 0, {}).routes_tensor() is None


def test_report_gap_table_shows_the_routing_mismatch():
    from k3post.recipes.report import _gap_table

    html = _gap_table([("general.max", {"mean": 1e-7, "max": 1e-3, "tokens": 900.0, "routing_positions": 150.0,
                                        "routing_mismatch_frac": 0.02}),
                       ("general.low", {"mean": 2e-7, "max": 2e-3, "tokens": 800.0})])
    assert "routed differently" in html and "0.0200 of 150" in html
    row_low = html[html.index("general.low"):]
    assert "–" in row_low[: row_low.index("</tr>")]


def test_positions_older_weights_routed_are_counted_apart():
    """A position's route counts as the trained weights' when a token they sampled over their own KV comes after it
    (that token attended to every earlier position's KV, computed in the same forwards as the routes); the others
    (a trajectory of older weights, or tokens over KV kept from them) are the policy's move, counted apart. By hand,
    trained version 4, 9 recorded positions per sequence: fresh tokens at 5..9 -> positions 0..8 the trained
    weights'; version-3 tokens -> none; version-4 tokens over version-3 KV -> none; tokens of unknown version -> all."""
    model = _model()
    R = torch.randint(0, 8, (9, len(moe_routers(model)), 2), dtype=torch.int16)
    ids, mask = list(range(5, 15)), [False] * 5 + [True] * 5

    def seq(v: int | None, kv: int | None = None) -> TokenSequence:
        return TokenSequence(ids, mask, [0.0] * 10, [1.0] * 10, None if v is None else [-1] * 5 + [v] * 5,
                             None if kv is None else [-1] * 5 + [kv] * 5, routes=R)

    for seqs, fresh, older in (([seq(4)], 9, 0), ([seq(3)], 0, 9), ([seq(4, kv=3)], 0, 9), ([seq(4, kv=4), seq(3)], 9, 9),
                               ([seq(None)], 9, 0)):
        s = policy_grads(model, [(seqs, 0)], pad_id=0, token_normalizer=10.0, version=4)
        assert (s["routes_known"], s["routes_known_older"]) == (fresh, older), (fresh, older)


@pytest.mark.parametrize("renorm", [True, False])
def test_a_router_without_a_renormalise_flag_is_read_off_its_output(renorm):
    """Mixtral's router always renormalises and has no ``norm_topk_prob``: replay reads the rule off the router's own
    weights, so replaying the model's own routes gives its logits exactly, either way (the wrong rule would scale
    every expert's output by sum_k p)."""
    model = _model()

    class Plain(torch.nn.Module):
        def __init__(self, gate):
            super().__init__()
            self.weight, self.top_k = gate.weight, gate.top_k

        def forward(self, h):
            logits = torch.nn.functional.linear(h.reshape(-1, self.weight.shape[1]), self.weight)
            p, e = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
            return logits, (p / p.sum(-1, keepdim=True) if renorm else p).to(logits.dtype), e

    for layer in model.model.layers:
        layer.mlp.gate = Plain(layer.mlp.gate)
    ids = torch.tensor([_requests(1)[0].prompt_ids])
    own: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _a, out, i=i: own.__setitem__(i, out[2]))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        ref = model(ids).logits
    for h in hooks:
        h.remove()
    routes = torch.stack([own[i] for i in range(len(own))], dim=1)  # [T, M, K]
    rp = RouteReplay(model)
    rp.replay = True
    with torch.no_grad(), rp.replaying(routes):
        got = model(ids).logits
    rp.remove()
    assert rp.known == ids.shape[1] and rp.mismatched == 0 and torch.equal(got, ref)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_families_record_and_replay_or_refuse(family):
    """docs/post-train-your-own-model.md: every MoE family's routes are recorded, on the engine path it takes, where
    the model's own routing puts them. Replay recomputes the weights from the softmax of the router's logits, which
    the plain top-k routers follow (Qwen2-MoE with its shared expert, Qwen3-MoE, Mixtral, and gpt-oss, whose bias is
    in its logits): replaying their own routes gives the same logits (gpt-oss's up to fp32 rounding). DeepSeek-V3's grouped sigmoid router is
    refused before training (`check_replayable`, naming its first MoE layer: layer 0 is dense) and by the hook."""
    from k3post.models import build_tiny_family
    from k3post.routing_replay import check_replayable

    model = build_tiny_family(family, V, seed=0, pad_token_id=0, eos_token_id=1).eval()
    res = EmbeddedEngine(model, max_batch_size=3, max_model_len=64, record_routes=True, stop_ids=()).generate(
        _requests(3))
    known, bad = _own_mismatch(model, res)
    assert known == sum(len(r.routes) for r in res) and bad <= MAX_MISMATCH * known  # type: ignore[arg-type]
    ids = torch.tensor([res[0].prompt_ids + res[0].output_ids])
    routes = torch.full((ids.shape[1],) + tuple(res[0].routes.shape[1:]), -1, dtype=torch.long)
    routes[: len(res[0].routes)] = res[0].routes.long()
    rp = RouteReplay(model)
    rp.replay = True
    try:
        if family == "deepseek_v3":
            with pytest.raises(ValueError, match="layer 1's router .* plain top-k"):
                check_replayable(model)
            with pytest.raises(ValueError, match="layer 1's router .* plain top-k"), rp.replaying(routes):
                model(ids)
            return
        check_replayable(model)
        with torch.no_grad():
            ref = model(ids).logits
        with torch.no_grad(), rp.replaying(routes):
            got = model(ids).logits
    finally:
        rp.remove()
    if rp.mismatched == 0:  # gpt-oss softmaxes its top-k logits, replay gathers the full softmax and renormalises:
        # the same weights up to fp32 rounding (a few ulps, ~1e-7 relative), not bit for bit
        assert torch.equal(got, ref) if family != "gpt_oss" else torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
