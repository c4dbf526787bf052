"""`bench/agent_turns.py`: teacher-forced per-turn accuracy, checked with oracle policies (no model quality
involved): the reference itself scores every turn right; another task's reference keeps the tool names but
gets the copied arguments wrong."""

import importlib.util
from pathlib import Path

from k3post.envs.episode import run_episode_sync
from k3post.envs.families.registry import get_family
from k3post.envs.families.streams import eval_tasks
from k3post.rollout.evaluation import make_env
from k3post.xtml import XTML

_SPEC = importlib.util.spec_from_file_location("agent_turns", Path(__file__).resolve().parents[1] / "bench" / "agent_turns.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def _continuations(xtml, family, n):
    """prompt ids -> the reference turn's ids, per task, in the bench's order."""
    fam = get_family(family)
    out = []
    for task in eval_tasks([family], n, difficulty=1):
        ep = run_episode_sync(fam.reference_policy(task, "max"), make_env(task), task, verify=False)
        msgs = list(ep.messages)
        turns = []
        for i, m in enumerate(msgs):
            if m.get("role") == "assistant":
                pre = xtml.render(msgs[:i], tools=ep.tools or None, effort="max", add_generation_prompt=True).ids
                full = xtml.render(msgs[: i + 1], tools=ep.tools or None, effort="max").ids
                assert full[: len(pre)] == pre
                turns.append((tuple(pre), full[len(pre):]))
        out.append(turns)
    return out


def test_oracle_policies_score_as_expected(xtml_tokenizer, monkeypatch):
    x = XTML(xtml_tokenizer)
    conts = _continuations(x, "agents.search", 3)
    table = {pre: ids for turns in conts for pre, ids in turns}
    monkeypatch.setattr(bench, "complete", lambda model, prompts, **kw: [table[tuple(p)] for p in prompts])
    rows = bench.turn_accuracy(None, x, "agents.search", 3, "max", 192, max_len=1 << 20)
    assert len(rows) == sum(len(t) for t in conts) and all(r["call_ok"] and r["name_ok"] for r in rows)

    # task k answered with task k+1's reference turns: same tools, other entity names and doc ids
    shifted = {pre: conts[(k + 1) % 3][j][1] for k, turns in enumerate(conts) for j, (pre, _) in enumerate(turns)}
    monkeypatch.setattr(bench, "complete", lambda model, prompts, **kw: [shifted[tuple(p)] for p in prompts])
    rows = bench.turn_accuracy(None, x, "agents.search", 3, "max", 192, max_len=1 << 20)
    assert all(r["name_ok"] for r in rows) and not any(r["call_ok"] for r in rows if r["turn"] == 0)


def test_arguments_that_are_not_json_count_as_wrong_not_as_a_crash():
    msg = {"tool_calls": [{"function": {"name": "search", "arguments": "{\"query\": \"Calla"}}]}
    assert bench._calls(msg) == [("search", {"<unparsed>": '{"query": "Calla'})]


def test_a_turn_whose_history_fills_the_context_is_left_out_not_a_crash(xtml_tokenizer, monkeypatch):
    """Found on the full recipe's SFT model: an agents.assistant turn's history was 2,065 tokens, over the model's
    2,048 positions, and the engine refused it, ending the bench. Such turns are rows marked ``no_room``; the
    others are scored as before."""
    x = XTML(xtml_tokenizer)
    conts = _continuations(x, "agents.search", 3)
    table = {pre: ids for turns in conts for pre, ids in turns}
    asked: list[int] = []

    def fake(model, prompts, **kw):
        asked.extend(len(p) for p in prompts)
        return [table[tuple(p)] for p in prompts]

    monkeypatch.setattr(bench, "complete", fake)
    lens = sorted(len(pre) for turns in conts for pre, _ in turns)
    limit = lens[len(lens) // 2]  # about half the turns have no room
    rows = bench.turn_accuracy(None, x, "agents.search", 3, "max", 192, max_len=limit)
    kept = [r for r in rows if not r.get("no_room")]
    assert len(rows) == len(lens) and 0 < len(kept) < len(rows)
    assert max(asked) < limit and all(r["call_ok"] for r in kept)


def test_qat_flag_runs_the_model_as_the_recipes_engines_do(tmp_path, xtml_tokenizer, monkeypatch, capsys):
    """--qat loads the policy with MX QAT applied (a QAT-trained model runs so in the recipe); without it, unquantized;
    the JSON line says which."""
    import json

    from k3post.models import build_tiny_moe, save_model

    save_model(build_tiny_moe(len(xtml_tokenizer), seed=0, pad_token_id=xtml_tokenizer.pad_token_id), tmp_path / "m", xtml_tokenizer)
    seen = []
    real = bench.load_policy
    monkeypatch.setattr(bench, "load_policy", lambda path, qat: seen.append(qat) or real(path, qat))
    monkeypatch.setattr(bench, "turn_accuracy", lambda *a, **k: [{"task": "t", "turn": 0, "call_ok": False, "capped": False, "name_ok": False}])
    for flags, want in (([], False), (["--qat"], True)):
        assert bench.main([str(tmp_path / "m"), "--families", "agents.assistant", "--n", "1", *flags]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["qat"] is want
    assert seen[0] is None and seen[1].enabled
