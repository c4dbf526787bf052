"""k3post.rollout.replay: the modelled engine under the real scheduler reproduces a real run.

Recorded from real `EmbeddedEngine` runs of bench/partial_rollout.py's workload (synchronous and
partial, weights unchanged), a replay with the same settings gives the same engine step trace
(`StepWork` for `StepWork`) and the same trajectories, so a cost curve prices a simulated run exactly
as it prices the real one; other λ / staleness settings replay without a miss (the drain recorded
every turn of the stream); and a book that lacks a turn raises instead of inventing tokens.

Shape legend: none.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from k3post.rollout.cost_model import CostCurve, predict_engine_s
from k3post.rollout.engine import GenerationRequest, SamplingParams
from k3post.rollout.replay import ReplayBook, ReplayEngine, ReplayMiss, load_books, save_books

_BENCH = Path(__file__).parents[1] / "bench" / "partial_rollout.py"
_spec = importlib.util.spec_from_file_location("bench_partial_rollout_replay", _BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # type: ignore[union-attr]

ARGS = ["--repeats", "3", "--iters", "3", "--n", "2", "--k", "2", "--max-turn-tokens", "24", "--slots", "3",
        "--max-pos", "4096", "--max-staleness", "1"]
CURVE = CostCurve(batches=[1, 4], contexts=[100, 1000], decode_ms=[[0.5, 0.6], [0.8, 1.5]], prefill_tokens=[16, 1024],
                  prefill_ms=[1.0, 9.0], source="test curve", outside_ms_per_turn=0.25)


@pytest.fixture(scope="module")
def recorded(tiny_agent_policy, one_torch_thread):
    model, tok, xtml = tiny_agent_policy
    args = bench.parse_args(ARGS)
    tasks = bench.make_tasks(args.repeats * bench.prompts_per_repeat(args), seed=0)
    sync_runs, part_runs = bench.run_repeats(args, tiny_agent_policy, tasks)
    books = []
    for s, p in zip(sync_runs, part_runs):
        book = ReplayBook()
        assert book.merge(s["book"]) == 0 and book.merge(p["book"]) == 0  # both modes sampled the same turns
        books.append(book)
    return args, tok, xtml, tasks, sync_runs, part_runs, books


def _tokens(runs):
    return sorted((t.traj_id, tuple(t.token_ids)) for r in runs for t in r["trajs"])


def test_replay_with_the_same_settings_reproduces_the_step_trace(recorded, tmp_path):
    args, tok, xtml, tasks, sync_runs, part_runs, books = recorded
    assert any(r["stats"]["pauses"] for r in part_runs)  # partial rollout paused and resumed something
    path = save_books(tmp_path / "book.json.gz", books, {"seed": 0})
    books, meta = load_books(path)
    assert meta == {"seed": 0}
    s_sim, p_sim = bench.run_repeats(args, (None, tok, xtml), tasks, replay=books, curve=CURVE, quiet=True)
    for real, sim in ((sync_runs, s_sim), (part_runs, p_sim)):
        for r, s in zip(real, sim):
            assert s["work"] == r["work"]  # step for step: rows, their context, prefill tokens
            assert s["groups"] == r["groups"] and s["turns"] == r["turns"]
            # the simulated clock is the curve's price of the real trace, plus the turns outside the engine
            assert s["engine_s"] == pytest.approx(predict_engine_s(r["work"], CURVE), rel=1e-9)
            assert s["wall_s"] == pytest.approx(s["engine_s"] + s["turns"] * 0.25e-3, rel=1e-9)
        assert _tokens(sim) == _tokens(real)


def test_replay_under_other_settings_needs_no_unrecorded_turn(recorded):
    args, tok, xtml, tasks, sync_runs, part_runs, books = recorded
    for lam, st in ((0.5, 0), (0.9, 4)):
        s_sim, p_sim = bench.run_repeats(args, (None, tok, xtml), tasks, replay=books, curve=CURVE, lambda_=lam,
                                         max_staleness=st, quiet=True)
        assert [s["work"] for s in s_sim] == [r["work"] for r in sync_runs]  # λ = 1 does not depend on them
        assert all(p["groups"] >= 1 for p in p_sim)
        # every trajectory a simulation completes is the one the real runs sampled for that (group, sample)
        for real_run, sims in zip(sync_runs, zip(s_sim, p_sim)):  # trajectory ids repeat across repeats
            real = dict(_tokens([real_run]))
            for traj_id, ids in _tokens(list(sims)):
                if traj_id in real:
                    assert real[traj_id] == ids


def test_a_book_without_the_turn_raises():
    eng = ReplayEngine(ReplayBook(), CURVE, max_batch_size=2, max_model_len=64)
    with pytest.raises(ReplayMiss, match="no recorded turn for seed 7"):
        eng.add_request(GenerationRequest("r", [5, 6, 7], SamplingParams(seed=7, max_tokens=4)))
    book = ReplayBook()
    book.add(7, [5, 6, 7], [9, 9, 2], [-0.1, -0.2, -0.3], "stop")
    with pytest.raises(ReplayMiss, match="another prompt"):
        ReplayEngine(book).add_request(GenerationRequest("r", [5, 6, 8], SamplingParams(seed=7, max_tokens=4)))
    with pytest.raises(ValueError, match="two different turns"):
        book.add(7, [5, 6, 7], [9, 2], [0.0, 0.0], "stop")
    eng = ReplayEngine(book, CURVE, max_batch_size=2, max_model_len=64)
    res = eng.generate([GenerationRequest("r", [5, 6, 7], SamplingParams(seed=7, max_tokens=8, stop_ids=(2,)))])[0]
    assert res.output_ids == [9, 9, 2] and res.finish_reason == "stop" and res.output_logprobs == [-0.1, -0.2, -0.3]
    # prefill of 3 tokens (first token) then two decode steps of one row at contexts 4 and 5
    assert [(w.rows, w.context, w.prefill) for w in eng.work_log] == [(0, 0, 3), (1, 4, 0), (1, 5, 0)]


def test_a_bad_book_file_names_the_file(tmp_path):
    p = tmp_path / "x.json.gz"
    p.write_text("not gzip")
    with pytest.raises(ValueError, match=r"x\.json\.gz: not a gzipped replay file"):
        load_books(p)


def test_the_simulate_command_prices_a_grid_and_labels_it(recorded, tmp_path, capsys, monkeypatch):
    args, tok, xtml, tasks, sync_runs, part_runs, books = recorded
    monkeypatch.setattr(bench, "make_tokenizer", lambda: (tok, xtml))  # the tokenizer the book was recorded with
    book = save_books(tmp_path / "b.json.gz", books, {"seed": 0, "n": 2, "k": 2, "iters": 3, "repeats": 3,
                                                     "max_turn_tokens": 24, "max_pos": 4096})
    curve = CURVE.save(tmp_path / "c.json")
    sim = bench.parse_args(["--slots", "3", "--simulate", str(curve), "--book", str(book), "--sim-lambdas", "0.7",
                            "--sim-staleness", "1", "--sim-fixed-scale", "1,8", "--max-staleness", "1"])
    bench.simulate(sim)
    out = capsys.readouterr().out
    assert "iters = 3 as recorded" in out  # the book's protocol wins over the command line's defaults
    result = [json.loads(x) for x in out.splitlines() if x.startswith("{")][-1]
    assert result["simulated"] is True and len(result["grid"]) == 1 and len(result["fixed_scale"]) == 2
    assert all(line.startswith("SIMULATED") for line in out.splitlines() if "speedup" in line and line[0] != "{")
    # the grid point with the recorded setting is the curve's price of the real runs (same trace)
    rate = {m: [r["groups"] / (predict_engine_s(r["work"], CURVE) + r["turns"] * 0.25e-3) for r in runs]
            for m, runs in (("sync", sync_runs), ("partial", part_runs))}
    want = bench.ratio_summary("x", rate["partial"], rate["sync"])["x"]
    assert result["grid"][0]["sim_speedup_vs_sync"] == pytest.approx(want, rel=1e-9)
    # a larger fixed cost per step can only favour partial rollout (fewer steps per group)
    assert result["fixed_scale"][1]["sim_speedup_vs_sync"] >= result["fixed_scale"][0]["sim_speedup_vs_sync"]
    with pytest.raises(ValueError, match="--book: no such file"):
        bench.parse_args(["--simulate", str(curve), "--book", str(tmp_path / "missing.gz")])


def test_the_bench_command_fits_predicts_and_saves_a_book_that_replays(tmp_path, capsys, monkeypatch, one_torch_thread):
    fit, book = tmp_path / "fit.json", tmp_path / "book.json.gz"
    argv = ["partial_rollout.py", "--repeats", "3", "--iters", "2", "--n", "2", "--k", "2", "--max-turn-tokens", "64",
            "--slots", "4", "--max-pos", "4096", "--train-steps", "20", "--fit-curve", str(fit), "--save-book", str(book)]
    monkeypatch.setattr("sys.argv", argv)
    bench.main()
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    (pred,) = result["cost_model"].values()
    assert pred["sync_engine_s_predicted"] > 0 and pred["partial_engine_s_predicted"] > 0
    assert "fitted cost (ms) =" in out and CostCurve.load(fit).meta["linear"]["steps"] > 0
    books, meta = load_books(book)
    assert len(books) == 3 and all(len(b) for b in books) and meta["iters"] == 2
    # the simulation of the recorded setting with the fitted curve is that curve's price of the real run
    monkeypatch.setattr("sys.argv", ["partial_rollout.py", "--simulate", str(fit), "--book", str(book), "--slots", "4",
                                     "--sim-lambdas", "0.7", "--sim-staleness", "4"])
    bench.main()
    sim = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sim["grid"][0]["sim_speedup_vs_sync"] == pytest.approx(pred["predicted_speedup_vs_sync"], rel=1e-9)
