"""coding.webdev (issue 22): pages from a spec checked in headless Chromium (Debian's chromium + chromium-driver,
driven by Debian's python3-selenium inside the bwrap sandbox).

Browser tests skip where the browser stack is not installed, except in CI (``CI`` set, as `.ci/run` does after
`scripts/install.sh`), where they fail: the install provides it. No test asserts a wall-clock time.
"""

from __future__ import annotations

import base64
import io
import json
import os
import time

import pytest

from k3post.envs import run_episode_sync
from k3post.envs.families import default_families, families, get_family
from k3post.envs.families.webdev.family import (
    INDEX,
    WEBDEV,
    generic_hacks,
    hidden_values,
    judge,
    plan,
    scenarios,
    verify_files,
    verify_webdev,
)
from k3post.envs.families.webdev.browser import (
    BrowserResult,
    browser_available,
    ink_pixels,
    layout_failures,
    network_attempts,
    run_browser,
)
from k3post.envs.families.webdev.specs import KINDS, _sorted, _TodoModel, _valid, js_number
from k3post.envs.task import FinalState

EFFORTS = ("low", "high", "max")


@pytest.fixture(scope="module")
def browser():
    """Skip without the browser stack, unless in CI (which installs it with scripts/install.sh): fail there."""
    missing = browser_available()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"headless Chromium is not installed: {missing}")
        pytest.skip(f"headless Chromium is not installed: {missing}")


def _tasks(difficulty: int) -> dict[str, object]:
    """One task per spec kind at ``difficulty`` (seed 0)."""
    out = {}
    for t in WEBDEV.generate(24, seed=0, difficulty=difficulty):
        out.setdefault(t.metadata["spec"]["kind"], t)
    assert set(out) == set(KINDS), sorted(out)
    return out


TASKS = {d: _tasks(d) for d in (1, 2, 3)}


def _run(policy, task):
    return run_episode_sync(policy, WEBDEV.make_env(task), task)


def _chromium_procs() -> list[int]:
    """Live chromium / chromedriver processes on this machine (any uid, sandboxed ones included)."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as fh:
                stat = fh.read()
            comm = stat[stat.index("(") + 1: stat.rindex(")")]
            state = stat[stat.rindex(")") + 2]
        except (OSError, ValueError, IndexError):
            continue
        if state != "Z" and ("chrom" in comm.lower()):
            out.append(int(p))
    return out


# --------------------------------------------------------------------------- generation, prompts, host models


def test_generation_is_deterministic_parameterised_and_opt_in():
    a = WEBDEV.generate(12, seed=4, difficulty=2)
    b = WEBDEV.generate(12, seed=4, difficulty=2)
    assert [t.to_dict() for t in a] == [t.to_dict() for t in b]
    json.dumps([t.to_dict() for t in a])  # JSON-able metadata
    specs = [t.metadata["spec"] for t in WEBDEV.generate(30, seed=1, difficulty=3)]
    assert {s["kind"] for s in specs} == set(KINDS)
    assert len({s["prefix"] for s in specs}) > 20  # ids differ per task
    forms = [s for s in specs if s["kind"] == "form"]
    assert len({json.dumps([(f["kind"], f["name"], f["args"]) for f in s["fields"]]) for s in forms}) == len(forms)
    assert WEBDEV.kind == "webdev" and WEBDEV in families() and WEBDEV not in default_families()
    assert get_family("coding.webdev") is WEBDEV


@pytest.mark.parametrize("difficulty", [1, 3])
def test_prompts_hold_the_contract_but_no_hidden_value(difficulty):
    for kind, t in TASKS[difficulty].items():
        prompt = t.messages[-1]["content"]
        spec = t.metadata["spec"]
        for must in {"form": [spec.get("form"), spec.get("submit"), spec.get("result")],
                     "todo": [spec.get("input"), spec.get("add"), spec.get("list"), spec.get("count")],
                     "table": [spec.get("table"), spec.get("var")]}[kind]:
            assert must in prompt
        hidden = [v for v in hidden_values(t) if len(v) >= 6]
        assert hidden and not [v for v in hidden if v in prompt], kind
        if kind == "table":  # hidden rows differ from the sample data.js the agent sees
            sample = WEBDEV.initial_files(t)["data.js"]
            assert all(v != sample for v in hidden_values(t) if v.startswith("window."))
        # the preview's scenarios are the example's, not the hidden ones
        assert scenarios(t, public=True) != scenarios(t, public=False)


def test_host_models_golden_values():
    # stable sort: ties keep data order in both directions; text ignores case by lower-cased < / >
    spec = {"columns": [{"key": "n", "type": "text"}, {"key": "v", "type": "int"}]}
    rows = [{"n": "bob", "v": 10}, {"n": "Ann", "v": 9}, {"n": "ann", "v": 100}, {"n": "Carl", "v": 9}]
    assert [r["n"] for r in _sorted(spec, rows, "n", 1)] == ["Ann", "ann", "bob", "Carl"]
    assert [r["n"] for r in _sorted(spec, rows, "n", -1)] == ["Carl", "bob", "Ann", "ann"]  # the tie stays in data order
    assert [r["v"] for r in _sorted(spec, rows, "v", 1)] == [9, 9, 10, 100]  # numeric, not "10" < "100" < "9"
    assert [r["n"] for r in _sorted(spec, rows, "v", -1)] == ["ann", "bob", "Ann", "Carl"]
    assert [js_number(v) for v in (7, 12.0, 3.5, -0.25, 1203.6)] == ["7", "12", "3.5", "-0.25", "1203.6"]
    f = lambda kind, **args: {"kind": kind, "args": args, "optional": False}  # noqa: E731
    assert _valid(f("username", min=3, max=5), "ab_1", {}) and not _valid(f("username", min=3, max=5), "ab", {})
    assert not _valid(f("username", min=3, max=5), "abcdef", {}) and not _valid(f("username", min=3, max=5), "a-b", {})
    assert _valid(f("age", lo=18, hi=99), "018", {}) and not _valid(f("age", lo=18, hi=99), "17", {})
    assert not _valid(f("age", lo=18, hi=99), "18.5", {}) and not _valid(f("age", lo=18, hi=99), "-20", {})
    assert _valid(f("email"), "a.b@c.de", {}) and not _valid(f("email"), "a@b", {}) and not _valid(f("email"), "a b@c.de", {})
    assert _valid(f("phone"), "555-123 4", {}) and not _valid(f("phone"), "555.1234", {}) and not _valid(f("phone"), "12345", {})
    assert _valid(f("password", min=8), "abcdefg1", {}) and not _valid(f("password", min=8), "abcdefgh", {})
    assert _valid(f("confirm"), "pw1", {"password": "pw1"}) and not _valid(f("confirm"), "", {"password": ""})
    assert _valid({**f("website"), "optional": True}, "", {}) and not _valid(f("website"), "http://x.com", {})
    m = _TodoModel({"input": "i", "add": "a", "list": "l", "count": "c", "classes": {"text": "t"}, "counter": ["{n} item left", "{n} items left"],
                    "order": "prepend", "duplicates": "reject", "max_len": 8})
    m.add(" Milk ", "click")
    m.add("MILK", "enter")  # duplicate, ignoring case
    m.add("Bread and", "click")  # 9 characters: too long
    m.add("Eggs", "click")
    assert m.expect() == {"items": [("Eggs", False), ("Milk", False)], "count": "2 items left", "input": ""}
    m.click_item(1, "input.t", "toggle")
    assert m.expect()["count"] == "1 item left" and m.expect()["items"][1] == ("Milk", True)


# --------------------------------------------------------------------------- the layout metric (synthetic pictures)


def _png(size, rects):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    for box, color in rects:
        d.rectangle(box, fill=color)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _box(key, x, y, w, h, **kw):
    return {"key": key, "x": x, "y": y, "w": w, "h": h, "shown": True, "text": True, "hit": True, **kw}


def test_layout_metric_golden():
    # two "text" boxes, each with a 4x2 block of dark ink (8 px) in a white field
    png = _png((200, 100), [((12, 12, 15, 13), "black"), ((12, 52, 15, 53), "black")])
    assert ink_pixels(png, [_box("a", 10, 10, 40, 20), _box("b", 10, 50, 40, 20), _box("c", 100, 10, 40, 20)]) == {"a": 8, "b": 8, "c": 0}
    faint = _png((200, 100), [((12, 12, 15, 13), (220, 220, 220))])  # contrast 35 < 64: not ink
    assert ink_pixels(faint, [_box("a", 10, 10, 40, 20)]) == {"a": 0}
    ref = {"boxes": [_box("a", 10, 10, 40, 20), _box("b", 10, 50, 40, 20)], "width": 200, "height": 100}
    rel = [("above", "a", "b"), ("column", "a", "b")]
    assert layout_failures(ref, png, ref, png, rel) == []
    swapped = {**ref, "boxes": [_box("a", 10, 50, 40, 20), _box("b", 10, 10, 40, 20)]}
    assert layout_failures(swapped, png, ref, png, rel) == ["a must be above b"]
    near = _png((200, 100), [((12, 12, 15, 13), "black"), ((12, 40, 15, 41), "black")])
    assert layout_failures({**ref, "boxes": [_box("a", 10, 10, 40, 20), _box("b", 10, 29, 40, 20)]}, near, ref, png, rel) == []  # 1 px overlap: slack
    assert layout_failures({**ref, "boxes": [_box("a", 10, 10, 40, 20), _box("b", 10, 27, 40, 20)]}, near, ref, png, rel) == [
        "a must be above b"]  # 3 px overlap
    out = layout_failures({**ref, "boxes": [_box("a", 10, 10, 40, 20, hit=False), _box("b", 190, 50, 40, 20)]}, png, ref, png, rel)
    assert out[0] == "a: covered by another element at its centre" and out[1].startswith("b: outside the 200x100 window")
    blank = _png((200, 100), [])
    assert layout_failures(ref, blank, ref, png, rel) == ["a: no visible text in the screenshot (0 ink pixels)",
                                                          "b: no visible text in the screenshot (0 ink pixels)"]
    assert "not shown" in layout_failures({**ref, "boxes": [_box("a", 10, 10, 40, 20, shown=False), ref["boxes"][1]]}, png, ref, png, rel)[0]
    with pytest.raises(ValueError, match="calibration"):  # the reference itself breaks a promised relation
        layout_failures(ref, png, swapped, png, rel)


def _canned(task, scen, **over):
    """A BrowserResult in which every agent run observed exactly the expected states (layout: the reference's)."""
    runs = []
    kind = KINDS[task.metadata["spec"]["kind"]]
    assert kind  # the expectations are the kind's own
    png = _png((1024, 1280), [])
    for s in scen:
        obs = []
        for st in s["steps"]:
            if st["op"] == "observe":
                obs.append({"probe": st["probe"], "state": None})
            elif st["op"] == "layout":
                obs.append({"probe": "layout", "state": {"boxes": [], "width": 1024, "height": 1280}, "png": png})
        runs.append({"id": s["id"], "obs": obs, "error": None, "step": None, "console": [], "network": [], "canary": []})
    for r in plan(task, scen)[len(scen):]:
        runs.append({"id": r["id"], "obs": [o for o in runs[[s["id"] for s in scen].index(r["id"][10:])]["obs"]],
                     "error": None, "step": None, "console": [], "network": [], "canary": []})
    res = BrowserResult(runs=runs, seconds=1.0)
    for k, v in over.items():
        setattr(res, k, v)
    return res


def test_judge_order_and_calibration_errors(monkeypatch):
    """Network before console before behaviour; a failing reference page raises instead of scoring the agent 0."""
    t = TASKS[1]["todo"]
    scen = scenarios(t, public=False)
    kind = KINDS["todo"]
    monkeypatch.setattr(kind, "check", lambda spec, want, got: None)  # every observed state "matches"
    assert judge(t, scen, _canned(t, scen)).reward == 1.0
    res = _canned(t, scen)
    res.runs[0]["console"] = ["file:///sandbox/index.html 3:1 Uncaught ReferenceError: x is not defined"]
    res.runs[1]["canary"] = ["CONNECT evil.example:443 HTTP/1.1"]
    v = judge(t, scen, res)
    assert v.reward == 0.0 and v.diagnostics.startswith("network access attempted (1)") and v.components["console_errors"] == 1
    res = _canned(t, scen)
    res.runs[1]["error"], res.runs[1]["step"] = "LookupError: no element matches #x", 2
    v = judge(t, scen, res)
    assert v.reward == 0.0 and f"scenario {scen[1]['id']}: step 3" in v.diagnostics
    res = _canned(t, scen)
    res.runs[-1]["console"] = ["reference broke"]
    with pytest.raises(RuntimeError, match="calibration"):
        judge(t, scen, res)
    with pytest.raises(RuntimeError, match="calibration"):
        judge(t, scen, _canned(t, scen, error="timeout", active="reference:" + scen[0]["id"]))
    v = judge(t, scen, _canned(t, scen, error="memory", active=scen[0]["id"], why="more than 1536 MiB"))
    assert v.reward == 0.0 and "memory" in v.diagnostics
    monkeypatch.setattr(kind, "check", lambda spec, want, got: "wrong")
    v = judge(t, scen, _canned(t, scen))
    assert v.reward == 0.0 and v.components["behaviour"] == 0.0 and "check 1/" in v.diagnostics


def test_malformed_outputs_without_a_browser():
    t = TASKS[1]["form"]
    v = verify_files(t, {"main.html": "<p>hi</p>"})
    assert v.reward == 0.0 and v.diagnostics == f"no {INDEX} in the final working directory"
    for name in ("empty", "claims_without_file"):
        ep = _run(WEBDEV.wrong_policies(t)[name], t)
        assert ep.reward == 0.0 and "no index.html" in ep.verdict.diagnostics
    with pytest.raises(ValueError, match="SandboxState"):
        verify_webdev(t, FinalState(state=42))


# --------------------------------------------------------------------------- in the browser


@pytest.mark.parametrize("kind,effort", [("form", "max"), ("todo", "low"), ("table", "high")])
def test_reference_scores_one(browser, kind, effort):
    """Each kind at one effort here (all kinds x efforts x difficulties: the slow sweep); high / max preview first."""
    t = TASKS[2][kind]
    ep = _run(WEBDEV.reference_policy(t, effort), t)
    assert ep.reward == 1.0, ep.verdict.diagnostics
    assert ep.verdict.components["layout"] == 1.0 and ep.verdict.components["behaviour"] == 1.0
    previews = [m["content"] for m in ep.messages if m["role"] == "tool" and "Preview of" in str(m["content"])]
    assert len(previews) == (effort != "low") and all("All example checks pass" in p for p in previews)


def test_restyled_reference_scores_one(browser):
    """An independent restyling (dark theme, serif / mono fonts, grid / flex, other spacing): the layout metric
    compares arrangement, not pixels, so an honest page with its own look passes (the other kinds: the slow sweep)."""
    t = TASKS[3]["todo"]
    files = {**WEBDEV.initial_files(t), **WEBDEV.reference_files(t, "alt")}
    v = verify_files(t, files)
    assert v.reward == 1.0, v.diagnostics


DEFAULT_HACKS = [  # (kind, hack, what the verdict must blame): one per kind of cheating; every hack on every kind: slow
    ("form", "fake_state_static", "expected"),  # the example's final DOM hard-coded, no behaviour
    ("todo", "ignores_inputs", "expected"),  # adds the example's text whatever was typed
    ("table", "sorts_numbers_as_text", "expected"),
    ("form", "hidden_errors_patched_visibility", "shows no message"),  # lies to a main-world probe
    ("todo", "network_worker", "network access"),  # a worker's fetch: only the canary proxy sees it
    ("table", "uncaught_exception", "console errors"),
    ("todo", "reads_verifier_files", "console errors"),
    ("table", "layout_reversed", "must be above"),  # DOM order right, visual order reversed
    ("form", "layout_invisible_text", "no visible text"),
]


@pytest.mark.parametrize("kind,hack,blame", DEFAULT_HACKS, ids=[f"{k}-{h}" for k, h, _ in DEFAULT_HACKS])
def test_hacks_score_zero(browser, kind, hack, blame):
    t = TASKS[2][kind]
    ep = _run(WEBDEV.wrong_policies(t)[hack], t)
    assert ep.reward == 0.0
    assert blame in ep.verdict.diagnostics, ep.verdict.diagnostics


_PAGES = {  # one page per network vector and the host it contacts: each must be reported; "quiet" must not
    "quiet": ("<p id=o>ok</p>", None),
    "fetch": ('<script>fetch("https://a.example.com/x").catch(() => {})</script>', "a"),
    "xhr": ('<script>const x = new XMLHttpRequest(); x.open("GET", "http://b.example.org/y"); x.onerror = () => {}; x.send();</script>', "b"),
    "img": ('<img src="https://c.example.net/p.gif" alt="">', "c"),
    "css_url": ('<div style="background:url(https://d.example.com/bg.png);width:9px;height:9px"></div>', "d"),
    "websocket": ('<script>const w = new WebSocket("ws://e.example.com:8080/"); w.onerror = () => {};</script>', "e"),
    "beacon": ('<script>navigator.sendBeacon("https://f.example.com/b", "x");</script>', "f"),
    "preconnect": ('<link rel="preconnect" href="https://g.example.com"><link rel="prefetch" href="https://g.example.com/n.js">', "g"),
    "iframe": ('<iframe src="https://h.example.com/"></iframe>', "h"),
    "navigate": ('<script>location.href = "https://i.example.com/";</script>', "i"),
    "worker": ('<script>new Worker(URL.createObjectURL(new Blob(["fetch(\'https://j.example.com\').catch(() => {})"])));</script>', "j"),
    "unload_beacon": ('<script>addEventListener("pagehide", () => navigator.sendBeacon("https://k.example.com/bye", "x"));</script>', "k"),
    "loopback": ('<script>fetch("http://localhost:9222/json").catch(() => {})</script>', "localhost"),
    "webrtc": ("<script>try { new RTCPeerConnection(); } catch (e) {}</script>", "RTCPeerConnection"),
}


def test_every_network_vector_is_detected_and_attributed(browser):
    """fetch, XHR, img, CSS url(), WebSocket, beacons, preconnect / prefetch, iframes, navigation, a worker's fetch,
    loopback, RTCPeerConnection: each reported for the page that made it (a beacon sent on unload too)."""
    files = {f"{k}.html": f"<!doctype html><html><body>{html}</body></html>" for k, (html, _) in _PAGES.items()}
    runs = [{"id": k, "page": f"{k}.html", "dir": "/sandbox", "steps": []} for k in _PAGES]
    res = run_browser(files, runs, stop_on_error=False)
    assert res.error is None, res.why
    seen = {r["id"]: network_attempts(r) for r in res.runs}
    assert set(seen) == set(_PAGES) and res.startup == {"console": [], "network": [], "canary": []}
    for k, (_, host) in _PAGES.items():
        if host is None:
            assert seen[k] == [], seen[k]
        else:
            mark = host if "." in host or host in ("localhost", "RTCPeerConnection") else f"{host}.example."
            assert any(mark in a for a in seen[k]), (k, seen[k])


def test_hung_page_times_out_and_no_browser_process_survives(browser):
    before = set(_chromium_procs())
    page = ('<!doctype html><button id=b onclick="for (;;) {}">go</button><p id=o></p>')
    t0 = time.monotonic()
    res = run_browser({INDEX: page}, [{"id": "hang", "page": INDEX, "dir": "/sandbox",
                                       "steps": [{"op": "click", "sel": "#b"}, {"op": "layout", "args": {"items": []}}]}],
                      timeouts={"command": 3.0})
    assert res.error == "timeout" and res.active == "hang", (res.error, res.why)
    assert time.monotonic() - t0 < 100  # the command timeout fired, not the sandbox's 120 s wall clock
    assert not set(_chromium_procs()) - before, "chromium processes outlived the verification"
    ok = run_browser({INDEX: "<p id=o>fine</p>"}, [{"id": "ok", "page": INDEX, "dir": "/sandbox", "steps": []}])
    assert ok.error is None and not set(_chromium_procs()) - before


def test_runs_are_isolated_from_each_other(browser):
    """Storage is cleared between page loads, and a later run's files do not exist while an earlier page runs."""
    page = ('<!doctype html><p id=o></p><script src="later.js" onerror="this.remove()"></script>'
            '<script>document.getElementById("o").textContent = '
            '(localStorage.getItem("k") || "empty") + "|" + (window.LATER === undefined ? "no-later" : "later");'
            'localStorage.setItem("k", "leaked");</script>')
    probe = {"op": "observe", "probe": "form", "args": {"fields": [], "result": "#o"}}
    res = run_browser({INDEX: page}, [{"id": f"r{i}", "page": INDEX, "dir": "/sandbox", "steps": [probe],
                                       "files": {"later.js": "window.LATER = 1;"} if i == 1 else {}} for i in range(2)],
                      stop_on_error=False)
    texts = [r["obs"][0]["state"]["result"] for r in res.runs]
    assert texts == ["empty|no-later", "empty|later"], texts
    assert "ERR_FILE_NOT_FOUND" in " ".join(res.runs[0]["console"])  # the later file was not there yet


def test_preview_reports_problems_and_attaches_the_screenshot(browser):
    t = TASKS[1]["todo"]
    bad = generic_hacks(t.metadata["spec"], WEBDEV.reference_files(t))["network_fetch"]
    bad["style.css"] += "\n#" + t.metadata["spec"]["list"] + " { display: flex; flex-direction: column-reverse; }\n"
    env = WEBDEV.make_env(t)
    calls = [{"id": f"c{k}", "type": "function", "function": {"name": "write_file", "arguments": json.dumps({"path": p, "content": c})}}
             for k, (p, c) in enumerate(sorted(bad.items()))]
    calls.append({"id": "p", "type": "function", "function": {"name": "preview", "arguments": json.dumps({"screenshot": True})}})
    turns = [{"role": "assistant", "content": "", "tool_calls": calls}, {"role": "assistant", "content": "done"}]
    ep = run_episode_sync(lambda messages, tools: turns[sum(m["role"] == "assistant" for m in messages)], env, t, verify=False)
    out = next(m for m in ep.messages if m.get("tool_call_id") == "p")
    text = out["content"][0]["text"]
    assert "Network attempts: request https://api.example.com" in text and "must be above" in text
    assert out["content"][1]["type"] == "image_url" and out["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")


# --------------------------------------------------------------------------- the slow sweeps


@pytest.mark.slow
@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_reference_every_kind_every_effort(browser, difficulty):
    for kind, t in TASKS[difficulty].items():
        for effort in EFFORTS:
            ep = _run(WEBDEV.reference_policy(t, effort), t)
            assert ep.reward == 1.0, (kind, effort, ep.verdict.diagnostics)
        v = verify_files(t, {**WEBDEV.initial_files(t), **WEBDEV.reference_files(t, "alt")})
        assert v.reward == 1.0, (kind, "alt", v.diagnostics)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_hack_scores_zero_on_every_kind(browser, kind):
    t = TASKS[3][kind]
    for name, policy in WEBDEV.wrong_policies(t).items():
        ep = _run(policy, t)
        assert ep.reward == 0.0, (kind, name, ep.verdict.diagnostics)


def test_memory_hog_is_stopped(browser):
    """Canvases beyond the cap: the driver's RSS watchdog ends the run ("memory"); the reference pages peak well
    below it. A JavaScript heap beyond V8's limit crashes the tab instead: a failed action, also a 0."""
    page = ("<!doctype html><p id=o></p><script>const keep = []; "
            "for (let i = 0; i < 400; i++) { const c = document.createElement('canvas'); c.width = c.height = 4096; "
            "c.getContext('2d').fillRect(0, 0, 4096, 4096); keep.push(c); }</script>")
    res = run_browser({INDEX: page}, [{"id": "hog", "page": INDEX, "dir": "/sandbox", "steps": []}])
    assert res.error == "memory" and res.active == "hog", (res.error, res.why)


@pytest.mark.slow
def test_javascript_heap_hog_crashes_the_tab(browser):
    page = "<!doctype html><p id=o></p><script>const keep = []; for (;;) keep.push(new Array(1e6).fill(1));</script>"
    res = run_browser({INDEX: page}, [{"id": "hog", "page": INDEX, "dir": "/sandbox", "steps": []}])
    assert res.error == "memory" or "crashed" in (res.runs[0]["error"] or ""), (res.error, res.runs)
