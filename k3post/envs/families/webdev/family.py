"""``coding.webdev``: write an HTML / CSS / JS page from a spec; headless Chromium checks behaviour and layout.

Spec kinds (`k3post.envs.families.webdev.specs.KINDS`), each parameterised per seed (element ids, field names
and validation rules, counter wording, list order and duplicate rules, columns, data, filters):

* ``form``: a form validated on submit (per-field error messages and ``aria-invalid``, a success message
  built from the typed values, inputs cleared on success);
* ``todo``: add (button / Enter, trimmed, empty / duplicate / too-long entries rejected by the spec's rules),
  toggle, delete, an open-items counter, filters and "clear completed" at difficulty 3;
* ``table``: a table rendered from ``data.js``, sorted by clicking headers (numeric / case-insensitive text,
  stable, toggling direction, ``aria-sort``), a filter at difficulty 2 and a row count at 3.

The agent writes files in a sandbox working directory (``write_file`` / ``read_file`` / ``list_files`` /
``edit_file``) and can ``preview`` its page: the verifier's own browser run on the prompt's example values.

Verification (`verify_files`): the final files go into a fresh sandbox and `browser.run_browser` plays
the hidden scenarios, drawn from the task's hidden seed (values typed, items added / toggled / deleted, other
``data.js`` rows), each in a fresh page load. Expected DOM states are computed on the host from the spec and
never enter the sandbox. Reward 1 iff, in this order:

1. no network attempt (requests of the page's target to non-local schemes, WebSockets, RTCPeerConnection, any
   connection reaching the run's canary proxy: from frames and workers alike);
2. no SEVERE console entry (``console.error``, uncaught exceptions and rejections, failed resource loads);
3. every observed DOM state (read in an isolated world) equals the expected one;
4. every scripted action succeeded (elements present, visible, not covered where clicked), and the browser run
   finished (no page-load / command timeout, memory cap, crash);
5. the layout metric (`browser.layout_failures`) finds nothing: the layout scenario is replayed on the
   reference page last (after the agent's page is gone, so its files never coexist with the agent's page) and
   the agent's rendering must show every key element the reference shows, visible, uncovered, inside the
   window, with ink in the screenshot, and keep every spec'd relation (above / left of / same line / same
   column) that holds in the reference rendering.

A failure of the reference page itself is a calibration error (RuntimeError), never a 0 for the agent; a
missing browser stack raises `BrowserUnavailableError`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

from k3post.envs.env import EpisodeLimits
from k3post.envs.families.common import FamilyBase, assistant
from k3post.envs.families.registry import register_family
from k3post.envs.families.visual.family import ImageToolEnvironment
from k3post.envs.families.webdev.browser import (
    BrowserResult,
    BrowserUnavailableError,
    console_errors,
    layout_failures,
    network_attempts,
    run_browser,
)
from k3post.envs.families.webdev.specs import KINDS, norm
from k3post.envs.sandbox_tools import (
    MAX_FILES,
    MAX_FILE_CHARS,
    TOOLS,
    SandboxState,
    clip,
    final_text_files,
    script_call,
)
from k3post.envs.task import FinalState, Task, Verdict, register_verifier
from k3post.envs.tools import ToolContext, ToolSpec

__all__ = [
    "INDEX",
    "WEBDEV",
    "BrowserUnavailableError",
    "WebdevFamily",
    "generic_hacks",
    "hidden_values",
    "judge",
    "plan",
    "preview_report",
    "scenarios",
    "verify_files",
    "verify_webdev",
]

INDEX = "index.html"
REFERENCE_DIR = "/tmp/k3post-reference"
"""Where the reference page is written inside the verification sandbox, for the last run only."""
TEXT_SUFFIXES = (".html", ".htm", ".css", ".js", ".mjs", ".json", ".svg", ".txt")

Browser = Callable[..., BrowserResult]


# --------------------------------------------------------------------------- plan and judgement


def _kind(task: Task) -> Any:
    return KINDS[task.metadata["spec"]["kind"]]


def scenarios(task: Task, *, public: bool) -> list[dict[str, Any]]:
    """The task's scenarios with their expectations: the example's (``public``) or the hidden ones."""
    md = task.metadata
    seed = md["public_seed"] if public else md["hidden_seed"]
    rng = random.Random(f"coding.webdev|{'public' if public else 'hidden'}|{seed}")
    return _kind(task).scenarios(md["spec"], rng, public=md["example"] if public else None)


def plan(task: Task, scen: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The browser runs: every scenario on the agent's page, then each layout scenario on the reference page (its
    steps up to the last layout snapshot). Expectations stay here; only the steps go to the sandbox."""
    runs = [{"id": s["id"], "page": INDEX, "dir": "/sandbox", "files": dict(s.get("files", {})), "steps": s["steps"]}
            for s in scen]
    ref = _kind(task).reference(task.metadata["spec"])
    for s in scen:
        if s.get("layout"):
            last = max(i for i, st in enumerate(s["steps"]) if st["op"] == "layout")
            runs.append({"id": "reference:" + s["id"], "page": INDEX, "dir": REFERENCE_DIR,
                         "files": {**ref, **s.get("files", {})}, "steps": s["steps"][: last + 1]})
    return runs


def _describe(step: Mapping[str, Any]) -> str:
    op = step["op"]
    if op == "type":
        return f"type {step['text']!r} into {step['sel']}"
    if op in ("click", "clear", "enter"):
        return f"{'press Enter in' if op == 'enter' else op} {step['sel']}"
    if op == "click_item":
        return f"click {step['target']} of the item {step['text']!r}"
    return op


def judge(task: Task, scen: Sequence[Mapping[str, Any]], res: BrowserResult) -> Verdict:
    """The verdict on a browser run of `plan` (see the module docstring for the order of the checks)."""
    kind, spec = _kind(task), task.metadata["spec"]
    runs = {r["id"]: r for r in res.runs}
    n_checks = sum(len(s["expect"]) for s in scen)
    comps = {"behaviour": 0.0, "layout": 0.0, "console_errors": 0.0, "network_attempts": 0.0, "browser_s": res.seconds}
    agent = [runs[s["id"]] for s in scen if s["id"] in runs]
    nets = [f"[{r['id']}] {a}" for r in agent for a in network_attempts(r)]
    cons = [f"[{r['id']}] {c}" for r in agent for c in console_errors(r)]
    comps["network_attempts"], comps["console_errors"] = float(len(nets)), float(len(cons))
    for rid, r in runs.items():
        if rid.startswith("reference:") and (r["error"] or network_attempts(r) or console_errors(r)):
            raise RuntimeError(f"coding.webdev calibration: the reference page failed in the verifier's browser ({rid}): "
                               f"{r['error'] or (network_attempts(r) + console_errors(r))[:3]}")

    def zero(why: str) -> Verdict:
        return Verdict(0.0, comps, why, res.weak_isolation)

    if res.error is not None and (res.active or "").startswith("reference:"):
        raise RuntimeError(f"coding.webdev calibration: the reference page's run failed ({res.error}): {res.why}")
    if nets:
        return zero(f"network access attempted ({len(nets)}): " + "; ".join(nets[:4]))
    if cons:
        return zero(f"browser console errors ({len(cons)}): " + "; ".join(cons[:4]))
    passed = 0
    failure: str | None = None  # the first wrong state, else the first failed action, else the run's failure
    for s in scen:
        r = runs.get(s["id"])
        if r is None:
            continue
        states = [o["state"] for o in r["obs"] if o["probe"] != "layout"]
        for i, (want, got) in enumerate(zip(s["expect"], states)):
            why = kind.check(spec, want, got)
            if why is None:
                passed += 1
            else:
                failure = failure or f"scenario {s['id']}, check {i + 1}/{len(s['expect'])}: {why}"
    comps["behaviour"] = passed / n_checks if n_checks else 0.0
    for s in scen:
        r = runs.get(s["id"])
        if failure is None and r is not None and r["error"]:
            step = s["steps"][r["step"]] if isinstance(r["step"], int) and 0 <= r["step"] < len(s["steps"]) else None
            failure = f"scenario {s['id']}: " + (f"step {r['step'] + 1} ({_describe(step)}) failed: " if step else "") + r["error"]
    if failure is None and res.error is not None:
        failure = f"the browser run failed ({res.error}) in scenario {res.active or '?'}: {res.why}"
    failure = failure or next((f"scenario {s['id']} did not run" for s in scen if s["id"] not in runs), None)
    if failure is not None:
        return zero(failure)
    problems: list[str] = []
    for s in scen:
        if not s.get("layout"):
            continue
        mine = [o for o in runs[s["id"]]["obs"] if o["probe"] == "layout"]
        ref = [o for o in runs.get("reference:" + s["id"], {"obs": []})["obs"] if o["probe"] == "layout"]
        if len(ref) != len(mine):
            raise RuntimeError(f"coding.webdev calibration: {len(ref)} reference layout snapshots for {len(mine)} of the agent")
        for k, (a, b) in enumerate(zip(mine, ref)):
            problems += [f"[{s['id']} #{k + 1}] {p}" for p in layout_failures(a["state"], a["png"], b["state"], b["png"],
                                                                                kind.relations(spec))]
    if problems:
        return zero(f"layout ({len(problems)} problems): " + "; ".join(problems[:5]))
    comps["layout"] = 1.0
    return Verdict(1.0, comps, f"all {n_checks} checks in {len(scen)} scenarios pass; layout matches the reference "
                               f"rendering; no console errors or network attempts ({res.seconds:.1f} s in the browser)",
                   res.weak_isolation)


def verify_files(task: Task, files: Mapping[str, str], *, browser: Browser | None = None) -> Verdict:
    """Reward of the page made of ``files`` on the hidden scenarios (``browser`` is injectable for tests)."""
    if INDEX not in files:
        return Verdict(0.0, {"behaviour": 0.0, "layout": 0.0}, f"no {INDEX} in the final working directory")
    scen = scenarios(task, public=False)
    res = (browser or run_browser)(files, plan(task, scen))
    return judge(task, scen, res)


def _is_web_file(path: str) -> bool:
    pure = PurePosixPath(path)
    return path.lower().endswith(TEXT_SUFFIXES) and not pure.is_absolute() and ".." not in pure.parts


def _web_files(state: Any) -> dict[str, str]:
    """The final text files (path -> text) of the working directory, at most `MAX_FILES` of `MAX_FILE_CHARS`."""
    ok = {p: t for p, t in final_text_files(state, _is_web_file, "webdev verifier").items() if len(t) <= MAX_FILE_CHARS}
    return dict(list(ok.items())[:MAX_FILES])


@register_verifier("coding.webdev")
def verify_webdev(task: Task, final: FinalState) -> Verdict:
    """1 iff the final page passes every hidden scenario in headless Chromium (see the module docstring), else 0."""
    return verify_files(task, _web_files(final.state))


# --------------------------------------------------------------------------- the preview tool


def preview_report(task: Task, files: Mapping[str, str], *, browser: Browser | None = None) -> tuple[str, str | None]:
    """The ``preview`` tool's text and the screenshot of the example's layout state (base64 PNG or None)."""
    if INDEX not in files:
        return f"FAIL: {INDEX} does not exist yet. Write it with write_file.", None
    scen = scenarios(task, public=True)
    res = (browser or run_browser)(files, plan(task, scen), stop_on_error=False)
    kind, spec = _kind(task), task.metadata["spec"]
    runs = {r["id"]: r for r in res.runs}
    lines = [f"Preview of {INDEX} in headless Chromium (1024 x 1280 window) on the example:"]
    png: str | None = None
    bad = 0
    if res.error is not None:
        lines.append(f"The browser run failed ({res.error}): {res.why}")
        bad += 1
    for s in scen:
        r = runs.get(s["id"])
        if r is None:
            continue
        states = [o["state"] for o in r["obs"] if o["probe"] != "layout"]
        whys = [kind.check(spec, w, g) for w, g in zip(s["expect"], states)]
        fails = [f"check {i + 1}: {w}" for i, w in enumerate(whys) if w]
        if r["error"]:
            step = s["steps"][r["step"]] if isinstance(r["step"], int) and 0 <= r["step"] < len(s["steps"]) else None
            fails.append((f"step {r['step'] + 1} ({_describe(step)}): " if step else "") + r["error"])
        lines.append(f"[{s['id']}] " + ("PASS" if not fails else "FAIL " + "; ".join(fails[:3])) +
                     f" ({len(states)}/{len(s['expect'])} checks read)")
        bad += bool(fails)
        shots = [o for o in r["obs"] if o["probe"] == "layout"]
        if shots:
            png = shots[-1]["png"]
    nets = [a for r in runs.values() if not r["id"].startswith("reference:") for a in network_attempts(r)]
    cons = [c for r in runs.values() if not r["id"].startswith("reference:") for c in console_errors(r)]
    lines.append("Network attempts: " + ("none" if not nets else "; ".join(nets[:5])))
    lines.append("Console errors: " + ("none" if not cons else "; ".join(cons[:5])))
    bad += bool(nets) + bool(cons)
    problems: list[str] = []
    for s in scen:
        if not s.get("layout") or s["id"] not in runs or "reference:" + s["id"] not in runs:
            continue
        mine = [o for o in runs[s["id"]]["obs"] if o["probe"] == "layout"]
        ref = [o for o in runs["reference:" + s["id"]]["obs"] if o["probe"] == "layout"]
        for a, b in zip(mine, ref):
            problems += layout_failures(a["state"], a["png"], b["state"], b["png"], kind.relations(spec))
    lines.append("Layout against the reference rendering: " + ("OK" if not problems else "; ".join(problems[:6])))
    bad += bool(problems)
    lines.append("All example checks pass (hidden tests use other values)." if not bad else f"{bad} problem(s) found.")
    return clip("\n".join(lines)), png


def _preview(ctx: ToolContext, screenshot: bool = False) -> str:
    """Load the page in headless Chromium and run the example checks."""
    assert ctx.task is not None
    state = ctx.state
    if not isinstance(state, SandboxState):
        raise ValueError("preview needs a webdev environment state")
    text, png = preview_report(ctx.task, _web_files(state))
    if screenshot and png is not None and isinstance(ctx.env, WebEnv):
        ctx.env.pending[ctx.call_id] = [png]
        text += "\nThe screenshot of the example's final state is attached."
    return text


_PREVIEW = ToolSpec(
    "preview", "Load index.html in headless Chromium, run the example checks from the task and report results, "
    "console errors, network attempts and layout problems; screenshot=true attaches a screenshot.",
    {"type": "object", "additionalProperties": False, "properties": {"screenshot": {"type": "boolean"}}},
    read_only=True, handler=_preview)
TOOL_NAMES = ("write_file", "read_file", "list_files", "edit_file", "preview")


def _library() -> dict[str, ToolSpec]:
    return {**{n: TOOLS[n] for n in TOOL_NAMES if n != "preview"}, "preview": _PREVIEW}


class WebEnv(ImageToolEnvironment):
    """A sandbox working directory and the webdev tools; ``preview`` results can carry the screenshot."""

    def __init__(self, files: Callable[[Task], Mapping[str, str]], limits: EpisodeLimits | None = None) -> None:
        super().__init__(list(_library().values()), initial_state=lambda t: SandboxState(files(t)), end_on_text=True,
                         limits=limits or EpisodeLimits(max_turns=16), dump_state=lambda s: s.to_json(),
                         load_state=SandboxState.from_json)


# --------------------------------------------------------------------------- hacks shared by the kinds


def _inject(files: Mapping[str, str], *, head: str = "", body_end: str = "", css: str = "") -> dict[str, str]:
    out = dict(files)
    html = out[INDEX]
    if head:
        html = html.replace("</head>", head + "\n</head>", 1)
    if body_end:
        html = html.replace("</body>", body_end + "\n</body>", 1)
    out[INDEX] = html
    if css:
        out["style.css"] = out.get("style.css", "") + "\n" + css
    return out


def _script(js: str) -> str:
    return f"<script>\n{js}\n</script>"


def generic_hacks(spec: Mapping[str, Any], reference: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """Pages that keep the reference's behaviour but add a forbidden effect, or break the layout (each must score 0)."""
    container = {"form": f"#{spec.get('form')}", "todo": f"#{spec.get('list')}", "table": f"#{spec.get('table')} > tbody"}[spec["kind"]]
    quiet = "catch(() => {})"
    return {
        "network_fetch": _inject(reference, body_end=_script(f'fetch("https://api.example.com/track?page=1").{quiet};')),
        "network_xhr": _inject(reference, body_end=_script(
            'try { const x = new XMLHttpRequest(); x.open("POST", "http://collect.example.org/log"); x.send("hi"); } catch (e) {}')),
        "network_image": _inject(reference, body_end='<img src="https://cdn.example.net/pixel.gif" alt="" width="1" height="1">'),
        "network_websocket": _inject(reference, body_end=_script(
            'try { const ws = new WebSocket("wss://socket.example.com/live"); ws.onerror = () => {}; } catch (e) {}')),
        "network_stylesheet": _inject(reference, head='<link rel="stylesheet" href="https://fonts.example.com/css?family=Inter">'),
        "network_worker": _inject(reference, body_end=_script(
            'new Worker(URL.createObjectURL(new Blob(["fetch(\'https://worker.example.com/x\').catch(() => {})"], '
            '{type: "text/javascript"})));')),
        "network_loopback": _inject(reference, body_end=_script(f'fetch("http://127.0.0.1:9515/status").{quiet};')),
        "network_webrtc": _inject(reference, body_end=_script(
            'try { const pc = new RTCPeerConnection({iceServers: [{urls: "stun:stun.example.com:3478"}]}); '
            'pc.createDataChannel("x"); pc.createOffer().then((o) => pc.setLocalDescription(o)).catch(() => {}); } catch (e) {}')),
        "console_error": _inject(reference, body_end=_script('console.error("debug: page loaded");')),
        "uncaught_exception": _inject(reference, body_end=_script(
            'document.addEventListener("click", () => { window.analytics.track("click"); });')),
        "syntax_error": {**_inject(reference, body_end='<script src="extra.js"></script>'), "extra.js": "function ( {\n"},
        # reads files the verifier might hold: /proc, the sandbox, the reference page's directory; uses whatever loads
        "reads_verifier_files": _inject(reference, body_end=(
            f'<script src="file://{REFERENCE_DIR}/app.js" onerror="this.remove()"></script>\n' + _script(
                'for (const u of ["file:///proc/self/environ", "file:///proc/1/cmdline", "file:///proc/2/fd/0", '
                '"file:///sandbox/", "file:///tmp/"]) {\n'
                '  const f = document.createElement("iframe"); f.src = u; f.style.display = "none";\n'
                '  f.onload = () => { try { document.title += f.contentDocument.body.textContent.slice(0, 40); } catch (e) {} };\n'
                '  document.body.append(f);\n'
                '  fetch(u).then((r) => r.text()).then((t) => { document.title += t.slice(0, 40); }).catch(() => {});\n'
                "}"))),
        # the DOM is right, the picture is not
        "layout_reversed": _inject(reference, css=f"{container} {{ display: flex; flex-direction: column-reverse; }}"),
        "layout_invisible_text": _inject(reference, css="body, body * { color: transparent !important; text-shadow: none !important; }"),
        "layout_covered": _inject(reference, body_end='<div style="position:fixed;inset:0;background:#fff;z-index:99;'
                                                     'pointer-events:none"></div>'),
        # an endless loop on the first click: a command times out, the browser is killed
        "hangs_on_click": _inject(reference, body_end=_script(
            'document.addEventListener("click", () => { for (;;) {} }, {capture: true, once: true});')),
    }


# --------------------------------------------------------------------------- the family


def _write_all(files: Mapping[str, str], turn: int = 0) -> list[dict[str, Any]]:
    return [script_call(turn, k + 1, "write_file", path=p, content=t) for k, (p, t) in enumerate(sorted(files.items()))]


_REASONING = {
    "form": ("One handler on the form's submit event: preventDefault, trim every value, run each field's rule, write "
             "or clear its error message and aria-invalid, then either the success message from the template (and "
             "reset the form) or an empty result. novalidate keeps the browser's own bubbles away."),
    "todo": ("Keep the items in an array and re-render the list from it after every change: add (trimmed, with the "
             "spec's rejection rules), toggle through the checkbox's change event, delete through the button, and "
             "recount the items not done for the counter."),
    "table": ("Keep the data order as the tie-breaker: sort a copy of window's rows with a comparator that is numeric "
              "for numbers and compares lower-cased text with < and >, falling back to the row index; a header click "
              "toggles the direction when it is the current column; render tbody from scratch and set aria-sort."),
}


class WebdevFamily(FamilyBase):
    """``coding.webdev``: an HTML / CSS / JS page from a spec, checked in headless Chromium."""

    name = "coding.webdev"
    domain = "coding"
    description = "Write a web page (form with validation, todo list, sortable table) from a spec; headless Chromium checks it."
    kind = "webdev"  # opt-in: verification drives a browser, so it stays out of the default mix
    id_prefix = "web"
    max_difficulty = 3

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        kind = KINDS[sorted(KINDS)[rng.randrange(len(KINDS))]]
        spec = kind.draw(rng, difficulty)
        example = kind.example(spec, rng)
        prompt = kind.prompt(spec, example)
        return self._task(task_id, [{"role": "user", "content": prompt}], {
            "difficulty": difficulty, "spec": spec, "example": example,
            "public_seed": rng.randrange(2**31), "hidden_seed": rng.randrange(2**31),
        }, tools=[_library()[n] for n in TOOL_NAMES])

    def initial_files(self, task: Task) -> dict[str, str]:
        kind = _kind(task)
        init = getattr(kind, "initial_files", None)
        return dict(init(task.metadata["spec"], task.metadata["example"])) if init else {}

    def make_env(self, task: Task, limits: EpisodeLimits | None = None) -> WebEnv:
        """A fresh environment: a sandbox working directory (``data.js`` for tables) and the webdev tools."""
        return WebEnv(self.initial_files, limits)

    def reference_files(self, task: Task, style: str = "plain") -> dict[str, str]:
        """The reference page (``style`` ``"alt"``: the independent restyling)."""
        return _kind(task).reference(task.metadata["spec"], style)

    def reference_turns(self, task: Task, effort: str) -> list[dict[str, Any]]:
        """Write the reference page, preview it (high / max; max first looks at the working directory), answer."""
        spec = task.metadata["spec"]
        files = self.reference_files(task)
        turns: list[dict[str, Any]] = []
        turn = 0
        if effort == "max":
            calls = [script_call(0, 1, "list_files")]
            if spec["kind"] == "table":
                calls.append(script_call(0, 2, "read_file", path="data.js"))
            turns.append(assistant("", "Start by looking at what the working directory already holds.", calls))
            turn = 1
        reasoning = {"low": "", "high": _REASONING[spec["kind"]].split(":")[0] + ".",
                     "max": (f"The spec fixes the ids and the behaviour exactly, and hidden tests use other values, so "
                             f"nothing may be hard-coded. {_REASONING[spec['kind']]} Layout: keep the spec's order "
                             "top to bottom and left to right with plain block and flex layout, inside the 1024 px "
                             "window. No external resources, so styles and scripts are local files.")}[effort]
        turns.append(assistant("", reasoning, _write_all(files, turn)))
        turn += 1
        if effort != "low":
            turns.append(assistant("", "Check it in the browser on the example." if effort == "max" else "",
                                   [script_call(turn, 1, "preview")]))
        what = {"form": "validates every field on submit and shows the result message",
                "todo": "adds, toggles and deletes items and keeps the counter",
                "table": "sorts by any column on a header click"}[spec["kind"]]
        turns.append(assistant(f"{INDEX} (with style.css and app.js) {what} as specified."))
        return turns

    def wrong_turns(self, task: Task) -> dict[str, list[dict[str, Any]]]:
        """Empty, claims, malformed pages, the kind's fake-state / ignored-input hacks and the generic hacks."""
        md = task.metadata
        spec, kind = md["spec"], _kind(task)
        ref = self.reference_files(task)
        done = assistant("The page is finished and meets the spec.")

        def files(fs: Mapping[str, str]) -> list[dict[str, Any]]:
            return [assistant("", "", _write_all(fs)), done]

        pages = {
            "copied_prompt": {INDEX: task.messages[-1]["content"]},
            "invalid_html": {INDEX: "<html><body><div id=\"main\"<<p>>unterminated <script>document.write(</body"},
            **kind.hacks(spec, md["example"]),
            **generic_hacks(spec, ref),
        }
        return {"empty": [assistant("")], "claims_without_file": [done], **{k: files(v) for k, v in pages.items()}}


WEBDEV = register_family(WebdevFamily())


def hidden_values(task: Task) -> list[str]:
    """Strings typed or loaded in the hidden scenarios (for tests: they must not appear in the prompt)."""
    out: list[str] = []
    for s in scenarios(task, public=False):
        out += [norm(st["text"]) for st in s["steps"] if st["op"] == "type" and norm(st["text"])]
        out += list(s.get("files", {}).values())
    return out
