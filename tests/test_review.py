"""The review queue: decisions with time and reviewer, no lost decisions under concurrency,
$EDITOR edits re-verified by replay, rendering, the CLI, and only accepted samples reaching training."""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from k3post.envs.families.general import family as general
from k3post.synth import JudgeResult, ReviewQueue, build_sft_dataset, read_jsonl, synthesize
from k3post.synth.cli import add_review_parser
from k3post.synth.review import render_item_plain

WRITING = general.WRITING
FLAG = [{"stage": "judge", "status": "uncertain", "reason": "judge_uncertain", "detail": "score 0.89: failed: no_filler"}]


@pytest.fixture(scope="module")
def blurbs() -> list[dict[str, Any]]:
    """Writing samples whose blurb got marketing filler appended (what the rule judge flags)."""
    out = []
    for s in synthesize(WRITING, effort="high", n=12, seed=5):
        s = copy.deepcopy(s)
        s["messages"][-1]["content"] = s["messages"][-1]["content"].rstrip(".!") + ", a great choice for everyone."
        out.append(s)
    return out


def _queue(tmp_path: Path, samples: list[dict[str, Any]]) -> ReviewQueue:
    q = ReviewQueue(tmp_path / "q")
    for s in samples:
        q.add(s, FLAG)
    return q


def test_decisions_are_logged_with_time_and_reviewer(tmp_path: Path, blurbs: list[dict[str, Any]]) -> None:
    q = _queue(tmp_path, blurbs[:3])
    a, b, c = (s["id"] for s in blurbs[:3])
    assert [it["status"] for it in q.items()] == ["pending"] * 3
    q.decide(a[:6], "accept", reviewer="ana", note="filler is fine here")  # a unique prefix works
    q.decide(b, "reject", reviewer="bo", note="salesy")
    assert {it["id"]: it["status"] for it in q.items()} == {a: "accepted", b: "rejected", c: "pending"}
    log = q.log()
    assert [(d["id"], d["decision"], d["reviewer"], d["note"]) for d in log] == [(a, "accept", "ana", "filler is fine here"), (b, "reject", "bo", "salesy")]
    assert all(d["time"].endswith("+00:00") and d["previous"] == "pending" for d in log)
    with pytest.raises(ValueError, match=rf"{b} was already rejected \(reject\) by bo at .*--force"):
        q.decide(b, "accept", reviewer="cy")
    q.decide(b, "accept", reviewer="cy", note="on second thought", force=True)
    assert q.get(b)["status"] == "accepted" and [d["decision"] for d in q.get(b)["decisions"]] == ["reject", "accept"]
    assert [s["id"] for s in q.accepted_samples()] == sorted([a, b])
    q.add(dict(blurbs[0], messages=[]), FLAG)  # re-adding a queued id changes nothing
    assert q.get(a)["sample"]["messages"] == blurbs[0]["messages"]
    with pytest.raises(ValueError, match="no review item 'zzz'"):
        q.get("zzz")
    with pytest.raises(ValueError, match="ambiguous"):
        q.resolve("s-")
    with pytest.raises(ValueError, match="decision must be"):
        q.decide(c, "maybe")


def _decide_many(root: str, ids: list[str], shared: str, who: str, results: Any) -> None:
    q = ReviewQueue(root)
    for i in ids:
        q.decide(i, "accept" if hash(i) % 2 else "reject", reviewer=who)
    try:
        q.decide(shared, "accept", reviewer=who)
        results.put((who, "won"))
    except ValueError:
        results.put((who, "lost"))


def test_concurrent_reviewers_lose_no_decision(tmp_path: Path, blurbs: list[dict[str, Any]]) -> None:
    q = _queue(tmp_path, blurbs)
    ids = q.ids()
    shared, rest = ids[0], ids[1:]
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    # 4 processes, each deciding its own items and racing for the shared one
    procs = [ctx.Process(target=_decide_many, args=(str(q.root), rest[k::4], shared, f"p{k}", results)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    outcomes = sorted(results.get(timeout=5)[1] for _ in procs)
    assert outcomes == ["lost"] * 3 + ["won"]
    log = q.log()
    assert len(log) == len(ids)  # every decision is in the log, once
    assert {d["id"] for d in log} == set(ids)
    assert all(it["status"] != "pending" for it in q.items())

    # threads of one process racing for one item: exactly one decision wins, the others are told
    q2 = _queue(tmp_path / "t", blurbs[:1])
    won: list[str] = []
    errors: list[str] = []

    def race(who: str) -> None:
        try:
            ReviewQueue(q2.root).decide(blurbs[0]["id"], "reject", reviewer=who, note="x")
            won.append(who)
        except ValueError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=race, args=(f"t{k}",)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(errors) == 5 and all(f"by {won[0]}" in e for e in errors)
    assert [d["reviewer"] for d in q2.log()] == won


def _editor(tmp_path: Path, body: str) -> str:
    script = tmp_path / "editor.py"
    script.write_text("import json, sys\npath = sys.argv[1]\nmsgs = json.load(open(path))\n" + body)
    return f"{sys.executable} {script}"


def test_edit_reverifies_and_accepts(tmp_path: Path, blurbs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    q = _queue(tmp_path, blurbs[:1])
    sid = blurbs[0]["id"]
    original = blurbs[0]["messages"][-1]["content"]
    fixed = original.replace(", a great choice for everyone.", ".")
    monkeypatch.setenv("EDITOR", _editor(tmp_path, f"msgs[-1]['content'] = {fixed!r}\njson.dump(msgs, open(path, 'w'))\n"))
    entry = q.edit(sid, reviewer="ana", note="removed filler")
    assert entry["decision"] == "edit" and entry["reviewer"] == "ana"
    assert [c["status"] for c in entry["checks"]] == ["keep", "keep", "keep"]  # structure, outcome (replayed), quality
    item = q.get(sid)
    assert item["status"] == "accepted" and item["sample"]["messages"][-1]["content"] == fixed
    assert item["edits"][0]["previous_messages"][-1]["content"] == original
    assert item["sample"]["reverified"]["status"] == "keep" and item["sample"]["tokens"]["method"] == "words"
    exported = read_jsonl(q.export(tmp_path / "accepted.jsonl"))
    assert [r["messages"][-1]["content"] for r in exported] == [fixed]
    assert not list((q.root / "edits").glob("*.json"))


def test_edit_failures_change_nothing(tmp_path: Path, blurbs: list[dict[str, Any]]) -> None:
    q = _queue(tmp_path, blurbs[:1])
    sid = blurbs[0]["id"]
    before = json.loads((q.items_dir / f"{sid}.json").read_text())
    one_sentence = _editor(tmp_path, "msgs[-1]['content'] = 'Nice.'\njson.dump(msgs, open(path, 'w'))\n")
    with pytest.raises(ValueError, match=r"fails re-verification: outcome: verifier_failed .*edit file kept at"):
        q.edit(sid, editor=one_sentence)
    broken = _editor(tmp_path, "open(path, 'w').write('[\\n  {\"role\": \"user\",\\n  oops]')\n")
    with pytest.raises(ValueError, match=r"\.json:3:3: invalid JSON after editing"):
        q.edit(sid, editor=broken)
    with pytest.raises(ValueError, match="were not changed"):
        q.edit(sid, editor=_editor(tmp_path, "pass\n"))
    with pytest.raises(ValueError, match="exited with status 3"):
        q.edit(sid, editor=_editor(tmp_path, "sys.exit(3)\n"))
    # another reviewer decides while this one is in the editor: a conflict, not an overwrite
    sneaky = _editor(
        tmp_path,
        "from k3post.synth.review import ReviewQueue\n"
        f"ReviewQueue({str(q.root)!r}).decide({sid!r}, 'reject', reviewer='bo', note='meanwhile')\n"
        "msgs[-1]['content'] = msgs[-1]['content'].replace(', a great choice for everyone.', '.')\n"
        "json.dump(msgs, open(path, 'w'))\n",
    )
    with pytest.raises(ValueError, match=r"changed while you edited it \(reject by bo"):
        q.edit(sid, editor=sneaky, reviewer="ana")
    after = json.loads((q.items_dir / f"{sid}.json").read_text())
    assert after == before and q.get(sid)["status"] == "rejected"
    assert [d["reviewer"] for d in q.log()] == ["bo"]


def test_render_plain_and_rich(tmp_path: Path, blurbs: list[dict[str, Any]]) -> None:
    q = _queue(tmp_path, blurbs[:1])
    sid = blurbs[0]["id"]
    q.decide(sid, "accept", reviewer="ana", note="ok")
    text = q.render(sid, use_rich=False)
    msg = blurbs[0]["messages"][-1]
    assert text.startswith("═") and f"{sid}  [accepted]  general.writing · effort high · teacher reference" in text
    assert "flag  judge: judge_uncertain - score 0.89" in text and "accept by ana: ok" in text
    assert "── [0] user " in text and "── [1] assistant " in text
    assert f"     think │ {msg['reasoning_content'].splitlines()[0]}" in text and f"  response │ {msg['content']}" in text
    pytest.importorskip("rich")
    rich_text = q.render(sid, use_rich=True, width=200)
    assert f"review {sid}" in rich_text and msg["content"] in rich_text and "[1] assistant" in rich_text
    calls = {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "search", "arguments": "{\"query\": \"x\"}"}}]}
    item = dict(q.get(sid), sample=dict(blurbs[0], messages=[calls]))
    assert '  call 1: search │ {\n' in render_item_plain(item) and '"query": "x"' in render_item_plain(item)


def _cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="k3post")
    add_review_parser(p.add_subparsers(dest="command", required=True))
    ns = p.parse_args(argv)
    return ns.fn(ns)


def test_review_cli(tmp_path: Path, blurbs: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    q = _queue(tmp_path, blurbs[:2])
    a, b = q.ids()
    root = str(q.root)
    assert _cli(["review", "list", "--queue", root]) == 0
    out = capsys.readouterr().out
    assert f"{a}  pending  general.writing  high    judge: judge_uncertain" in out and "2 items: 2 pending, 0 accepted, 0 rejected" in out
    assert _cli(["review", "accept", a, "--queue", root, "--reviewer", "ana"]) == 0
    assert _cli(["review", "reject", b, "--queue", root, "--reviewer", "bo", "--note", "too salesy"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):  # reject needs --note
        _cli(["review", "reject", b, "--queue", root])
    capsys.readouterr()
    assert _cli(["review", "show", b, "--queue", root, "--plain"]) == 0
    assert "reject by bo: too salesy" in capsys.readouterr().out
    assert _cli(["review", "list", "--queue", root, "--status", "accepted"]) == 0
    assert b not in capsys.readouterr().out
    assert _cli(["review", "export", str(tmp_path / "acc.jsonl"), "--queue", root]) == 0
    assert [r["id"] for r in read_jsonl(tmp_path / "acc.jsonl")] == [a]
    with pytest.raises(ValueError, match="no such review queue folder"):
        _cli(["review", "list", "--queue", str(tmp_path / "nope")])
    with pytest.raises(ValueError, match="already accepted"):
        _cli(["review", "reject", a, "--queue", root, "--note", "n"])


def test_only_accepted_or_unflagged_samples_reach_training(tmp_path: Path) -> None:
    class Unsure:
        def judge(self, sample: Any) -> JudgeResult:
            return JudgeResult(0.7, True, "a human should look")

    out = tmp_path / "sft.jsonl"
    args = ([general.ARITHMETIC, WRITING], ["low"], 2, 0, out)
    path, funnel = build_sft_dataset(*args, judges={"general.writing": Unsure()})
    assert funnel.final["uncertain"] == 2 and funnel.stages["judge"].reasons["uncertain"]["judge_uncertain"] == 2
    assert {r["family"] for r in read_jsonl(path)} == {"general.arithmetic"}
    q = ReviewQueue(tmp_path / "sft.review")
    first, second = q.ids()
    q.decide(first, "accept", reviewer="ana")
    q.decide(second, "reject", reviewer="ana", note="no")
    path, funnel = build_sft_dataset(*args, judges={"general.writing": Unsure()})  # resumes from the raw file
    recs = read_jsonl(path)
    assert sorted(r["id"] for r in recs if r["family"] == "general.writing") == [first]
    summary = json.loads((tmp_path / "sft.funnel.json").read_text())
    assert summary["accepted_from_review"] == 1 and summary["written"] == 3


class _Killed(BaseException):
    """Stands in for a SIGKILL at one point of an edit: what is on disk stays as it is there."""


def _edit_killed_at(q: ReviewQueue, sid: str, editor: str, where: Any, name: str, mp: pytest.MonkeyPatch) -> None:
    """Run an edit whose ``where.name`` is killed (raises `_Killed`) when called."""
    def killed(*args: Any) -> None:
        raise _Killed

    with mp.context() as m:
        m.setattr(where, name, killed)
        with pytest.raises(_Killed):
            q.edit(sid, editor=editor, reviewer="ana", note="removed filler")


def _fixing_editor(tmp_path: Path, sample: dict[str, Any]) -> str:
    fixed = sample["messages"][-1]["content"].replace(", a great choice for everyone.", ".")
    return _editor(tmp_path, f"msgs[-1]['content'] = {fixed!r}\njson.dump(msgs, open(path, 'w'))\n")


def test_an_edit_killed_before_its_log_record_changes_nothing_and_its_retry_succeeds(
        tmp_path: Path, blurbs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The log record is the edit's one commit point: a kill before it leaves the item file as it was (before
    issue 20 the item file was rewritten first, so the item read as pending with the edited messages and the
    retry failed with "the messages were not changed")."""
    q = _queue(tmp_path, blurbs[:1])
    sid = blurbs[0]["id"]
    before = (q.items_dir / f"{sid}.json").read_bytes()
    editor = _fixing_editor(tmp_path, blurbs[0])
    _edit_killed_at(q, sid, editor, ReviewQueue, "_append", monkeypatch)
    assert (q.items_dir / f"{sid}.json").read_bytes() == before and q.get(sid)["status"] == "pending"
    entry = q.edit(sid, editor=editor, reviewer="ana")
    assert entry["decision"] == "edit" and [d["decision"] for d in q.log()] == ["edit"]
    assert q.get(sid)["sample"]["messages"][-1]["content"].endswith(".")


def test_an_edit_killed_after_its_log_record_is_complete(
        tmp_path: Path, blurbs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A kill between the log record and the item file's rewrite: the item reads as accepted with the edited
    sample and its edit history (both from the record); a retry is told it is already decided; the export
    holds the edited sample."""
    q = _queue(tmp_path, blurbs[:1])
    sid = blurbs[0]["id"]
    original = blurbs[0]["messages"]
    editor = _fixing_editor(tmp_path, blurbs[0])
    from k3post.synth import review

    _edit_killed_at(q, sid, editor, review, "_write_item", monkeypatch)
    assert json.loads((q.items_dir / f"{sid}.json").read_text())["sample"]["messages"] == original  # not rewritten
    item = q.get(sid)
    assert item["status"] == "accepted" and not item["sample"]["messages"][-1]["content"].endswith("everyone.")
    assert item["sample"]["reverified"]["status"] == "keep"
    assert [e["previous_messages"] for e in item["edits"]] == [original] and item["edits"][0]["reviewer"] == "ana"
    with pytest.raises(ValueError, match=rf"{sid} was already accepted \(edit\) by ana"):
        q.edit(sid, editor=editor, reviewer="ana")
    exported = read_jsonl(q.export(tmp_path / "accepted.jsonl"))
    assert [r["messages"] for r in exported] == [item["sample"]["messages"]]
    # a forced second edit rewrites the item file with both edits in its history
    q.edit(sid, editor=_editor(tmp_path, "msgs[-1]['content'] = msgs[-1]['content'].rstrip('.') + '!'\njson.dump(msgs, open(path, 'w'))\n"),
           reviewer="bo", force=True)
    stored = json.loads((q.items_dir / f"{sid}.json").read_text())
    assert [e["reviewer"] for e in stored["edits"]] == ["ana", "bo"] and stored["sample"] == q.get(sid)["sample"]


def test_a_torn_last_decision_record_is_left_out_and_cut_off_by_the_next_decision(
        tmp_path: Path, blurbs: list[dict[str, Any]]) -> None:
    """A kill inside the append of a record (records carrying an edited sample pass 4 KB, past one atomic
    write) leaves a torn last line, here cut inside a multi-byte character: readers leave it out (it was
    never committed), the next append first cuts it off. A malformed line that ends in a newline is still an
    error naming the file and line."""
    q = _queue(tmp_path, blurbs[:2])
    a, b = q.ids()
    q.decide(a, "accept", reviewer="ana")
    whole = q.log_path.read_bytes()
    record = json.dumps({"id": b, "decision": "reject", "reviewer": "bø", "note": "x" * 5000}, ensure_ascii=False)
    torn = record.encode()[: record.encode().index("ø".encode()) + 1]  # ends inside "ø"
    q.log_path.write_bytes(whole + torn)
    assert [d["id"] for d in q.log()] == [a] and q.get(b)["status"] == "pending"
    q.decide(b, "reject", reviewer="bo", note="salesy")
    assert q.log_path.read_bytes().startswith(whole) and q.log_path.read_bytes().count(b"\n") == 2
    assert [(d["id"], d["reviewer"]) for d in q.log()] == [(a, "ana"), (b, "bo")]
    q.log_path.write_bytes(whole + b"{oops\n" + q.log_path.read_bytes()[len(whole):])
    with pytest.raises(ValueError, match=r"decisions.jsonl:2: malformed JSON at column 2.*malformed decision record"):
        q.log()
    q.log_path.write_bytes(whole + b'{"id": "\xff"}\n')  # invalid UTF-8 was a UnicodeDecodeError before issue 20
    with pytest.raises(ValueError, match=r"decisions.jsonl:2: not valid UTF-8 at byte 8.*malformed decision record"):
        q.log()
