"""Headless Chromium for ``coding.webdev``: one sandboxed browser run per verification, and the layout metric.

`run_browser` starts a fresh `Sandbox` (bubblewrap: no network namespace route, a private uid, a PID
namespace that dies with the run) holding the agent's files, and runs `DRIVER` there with Debian's
``/usr/bin/python3``: it starts Debian's ``chromedriver`` and ``chromium`` (headless) through Debian's
``python3-selenium``, loads the agent's page from ``file:///sandbox/...`` and plays the host's plan. The plan
(the hidden inputs to type, the clicks, which DOM states to read) arrives on stdin, which the driver closes
after reading; expected outcomes never enter the sandbox, the host compares (`k3post.envs.families.webdev.family`).

Inside the sandbox Chromium runs with ``--no-sandbox``: its own setuid / user-namespace sandbox cannot start
inside bubblewrap (bwrap runs the command with ``--disable-userns`` and no privileges), and the bwrap sandbox
around the whole browser is the isolation (docs/decisions.md, "Web development family").

What the driver reports, per run (a page load plus its steps):

* the steps' observations: DOM state read by `PROBES` in an **isolated world** (``Page.createIsolatedWorld``:
  the page's DOM, not its JavaScript globals, so a page that patches ``Element.prototype`` or a getter cannot
  lie to the verifier);
* a failed action (element missing, not interactable, click intercepted by another element, timeout) stops
  the run;
* layout snapshots: key elements' boxes, visibility and hit tests plus a PNG screenshot of the window.

and for the whole browser session: SEVERE console entries (``console.error``, uncaught exceptions and
promise rejections, failed resource loads), network attempts (every request the page's target made to a
scheme other than ``file:``, ``data:``, ``blob:``, ``about:``, WebSocket creations, ``RTCPeerConnection``
constructions, and every connection the browser made to the run's **canary proxy**: Chromium is started with
``--proxy-server`` pointing at a listener of the driver and ``--proxy-bypass-list=<-loopback>``, so every
HTTP(S) / WebSocket / beacon connection from any frame or worker, loopback included, reaches the canary and
is recorded; with no network in the namespace nothing gets further).

Timeouts: page load, every WebDriver command and every CDP call (`DRIVER_TIMEOUTS`), the browser start, and the
sandbox's wall clock around everything. A hung page (an endless loop in a handler) times a command out; the
driver then reports and exits, and the sandbox kills the process tree (PID namespace), so no Chromium
process outlives a run (tested by counting processes).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import shutil
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from k3post.envs.sandbox import Sandbox, SandboxLimits
from k3post.errors import InfrastructureError

__all__ = [
    "BrowserResult",
    "console_errors",
    "network_attempts",
    "BrowserUnavailableError",
    "CHROMEDRIVER",
    "CHROMIUM",
    "DRIVER",
    "VIEWPORT",
    "browser_available",
    "ink_pixels",
    "layout_failures",
    "run_browser",
]

CHROMIUM = "/usr/lib/chromium/chromium"
"""Debian's Chromium binary (the ``/usr/bin/chromium`` launcher script only adds flags we set ourselves)."""
CHROMEDRIVER = "/usr/bin/chromedriver"
SYSTEM_PYTHON = "/usr/bin/python3"
VIEWPORT = (1024, 1280)
"""The window the page is checked in (CSS px, device scale 1): every checked element must lie inside it."""
DRIVER_TIMEOUTS = {"start": 60.0, "load": 10.0, "command": 10.0}
"""Seconds: the browser start, a page load, any other WebDriver / CDP command."""
MEMORY_CAP = 1536 * 1024**2
"""Summed resident memory of the sandbox's processes above which the driver stops the run (``memory``)."""
BROWSER_LIMITS = SandboxLimits(cpu_s=120.0, wall_s=120.0, memory_bytes=2**40, nproc=1024, nofile=4096,
                               max_output_bytes=32 * 1024**2, tmpfs_bytes=512 * 1024**2)
"""Chromium's V8 reserves ~1 TiB of address space up front, so ``RLIMIT_AS`` cannot bound it (it fails to start at
32 GiB); memory is bounded by the driver's RSS watchdog (`MEMORY_CAP`) and V8's heap limit instead."""
INK_CONTRAST = 64
"""A pixel is ink when one channel differs from its box's most common colour by at least this much (0-255)."""
MIN_INK = 4
"""Fewest ink pixels a text element's box must hold in the screenshot."""
BOX_SLACK = 2.0
"""CSS px of tolerance in the layout relations (sub-pixel rounding, borders)."""


class BrowserUnavailableError(InfrastructureError):
    """Chromium, chromedriver or selenium is missing, or the browser did not start: not the page's fault (an
    infrastructure failure: the rollout is masked out of its group, `k3post.errors`)."""

    kind = "browser"


def browser_available() -> str | None:
    """None when the browser stack is installed, else what is missing (for skips and errors)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER, SYSTEM_PYTHON) if shutil.which(p) is None]
    if missing:
        return "missing " + ", ".join(missing) + " (run `bash scripts/install.sh`: apt-get install chromium chromium-driver python3-selenium)"
    import subprocess

    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import selenium.webdriver"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return "the system python has no selenium (run `bash scripts/install.sh`: apt-get install python3-selenium)"
    return None


# --------------------------------------------------------------------------- the driver (runs in the sandbox)

PROBES = r"""
const norm = s => (s || "").replace(/\s+/g, " ").trim();
const shown = el => !!el && el.isConnected && el.checkVisibility({opacityProperty: true, visibilityProperty: true})
                         && el.getClientRects().length > 0;
const q = (sel, root) => (root || document).querySelector(sel);
const qa = (sel, root) => Array.from((root || document).querySelectorAll(sel));
const box = (key, el, text) => {
  if (!el) return {key, missing: true};
  const r = el.getBoundingClientRect();
  const cx = r.left + r.width / 2, cy = r.top + r.height / 2;
  const hitEl = (cx >= 0 && cy >= 0 && cx < innerWidth && cy < innerHeight) ? document.elementFromPoint(cx, cy) : null;
  return {key, x: r.left, y: r.top, w: r.width, h: r.height, shown: shown(el), text: !!text && norm(el.textContent) !== "",
          hit: !!hitEl && (hitEl === el || el.contains(hitEl))};
};
const PROBES = {
  form(a) {
    const fields = {};
    for (const f of a.fields) {
      const inp = q(f.input), err = q(f.error);
      fields[f.name] = {present: !!inp, value: inp ? inp.value : null, error_present: !!err,
                        error: err ? norm(err.textContent) : "", error_shown: shown(err),
                        invalid: inp ? inp.getAttribute("aria-invalid") : null};
    }
    const res = q(a.result);
    const missing = a.fields.flatMap(f => [f.input, f.error]).concat([a.result]).filter(s => !q(s));
    return {fields, result_present: !!res, result: res ? norm(res.textContent) : "", result_shown: shown(res), missing};
  },
  todo(a) {
    const list = q(a.list);
    const items = list ? qa(":scope > li", list).filter(shown).map(li => {
      const t = q(a.text, li), c = q(a.toggle, li);
      return {text: t ? norm(t.textContent) : null, checked: c ? !!c.checked : null,
              done: li.classList.contains("done"), has_delete: !!q(a.remove, li)};
    }) : null;
    const cnt = q(a.count), inp = q(a.input);
    const missing = [a.list, a.count, a.input].filter(s => !q(s));
    return {items, count: cnt ? norm(cnt.textContent) : null, input: inp ? inp.value : null, missing};
  },
  table(a) {
    const t = q(a.table);
    if (!t) return {headers: null, rows: null, count: null, missing: [a.table]};
    const headers = qa(":scope > thead > tr > th", t).map(th => ({text: norm(th.textContent), sort: th.getAttribute("aria-sort")}));
    const rows = qa(":scope > tbody > tr", t).filter(shown).map(tr => qa(":scope > td", tr).map(td => norm(td.textContent)));
    const c = a.count ? q(a.count) : null;
    return {headers, rows, count: c ? norm(c.textContent) : null, missing: a.count && !c ? [a.count] : []};
  },
  mark(a) {
    let n = -1;
    for (const li of qa(a.items).filter(shown)) {
      const t = q(a.text_sel, li);
      if (t && norm(t.textContent) === a.text && ++n === a.occurrence) {
        const target = q(a.target, li);
        if (!target) return "item " + JSON.stringify(a.text) + " has no " + a.target;
        target.setAttribute("data-k3post-target", a.mark);
        return "ok";
      }
    }
    return "no shown item " + JSON.stringify(a.text) + " (occurrence " + a.occurrence + ") in " + a.items;
  },
  layout(a) {
    const out = [];
    for (const [key, sel, text, scope] of a.items) {
      if (scope) {  // every shown element matching `sel` inside each shown `scope` element: key.i.j
        qa(scope).filter(shown).forEach((s, i) => qa(sel, s).forEach((el, j) => out.push(box(key + "." + i + "." + j, el, text))));
      } else if (sel.endsWith("*")) {  // every shown match: key.i
        qa(sel.slice(0, -1)).filter(shown).forEach((el, i) => out.push(box(key + "." + i, el, text)));
      } else {
        out.push(box(key, q(sel), text));
      }
    }
    return {boxes: out, width: innerWidth, height: innerHeight,
            scroll: [document.documentElement.scrollWidth, document.documentElement.scrollHeight]};
  },
};
"""

DRIVER = r'''
import base64, json, os, socket, sys, threading, time, traceback
_out = sys.stdout
cfg = json.loads(sys.stdin.read())
sys.stdin.close()
os.close(0)
nonce = cfg.pop("nonce")
T = cfg["timeouts"]
t_start = time.monotonic()


emit_lock = threading.Lock()


def emit(obj):
    """One nonce-tagged JSON line; the watchdog may emit while the main thread still mutates the state."""
    for _ in range(20):
        try:
            line = json.dumps(obj)
            break
        except RuntimeError:  # a dict changed size during the dump
            time.sleep(0.005)
    else:
        line = json.dumps({"setup_failed": "could not serialise the report"})
    with emit_lock:
        _out.write(nonce + " " + line + "\n")
        _out.flush()


state = {"runs": [], "startup": {"console": [], "network": [], "canary": []}, "browser": [], "peak_rss": 0}
up = {"ready": False}  # not in `state`: the host tells the "ready" line from the report by their keys
internal = "k3post-%s.invalid" % os.urandom(8).hex()  # not the output nonce
SELFTEST = ("K3POST-SELFTEST-" + os.urandom(8).hex()).encode()
bucket = {"rec": state["startup"]}  # where console entries and canary connections go: the page that made them


def finish(error=None, why=""):
    if error:
        state["error"], state["why"] = error, str(why)[-2000:]
    state["seconds"] = time.monotonic() - t_start
    emit(state)
    os._exit(0)


# the memory watchdog: summed RSS of our uid's processes (the sandbox's, a PID namespace in bwrap)
def rss_total():
    me, total = os.getuid(), 0
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open("/proc/" + p + "/status") as fh:
                st = fh.read()
        except OSError:
            continue
        uid = rss = None
        for line in st.splitlines():
            if line.startswith("Uid:"):
                uid = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
        if uid == me and rss:
            total += rss
    return total


def watchdog():
    while True:
        rss = rss_total()
        state["peak_rss"] = max(state["peak_rss"], rss)
        if rss > cfg["memory_cap"]:
            if not up["ready"]:
                emit({"setup_failed": "the browser used %d MiB before any page was loaded (cap %d MiB)"
                                      % (rss >> 20, cfg["memory_cap"] >> 20)})
                os._exit(0)
            finish("memory", "the browser's processes used %d MiB, more than the cap of %d MiB"
                   % (rss >> 20, cfg["memory_cap"] >> 20))
        time.sleep(0.1)


threading.Thread(target=watchdog, daemon=True).start()

# the canary proxy: every connection Chromium makes goes here (loopback included), and nowhere else
canary = socket.socket()
canary.bind(("127.0.0.1", 0))
canary.listen(64)


def serve_canary():
    while True:
        conn, _ = canary.accept()
        conn.settimeout(1.0)
        try:
            line = conn.recv(512).split(b"\r\n")[0].decode("latin-1")
        except OSError as exc:
            line = "(no request line: %r)" % (exc,)
        # the browser's own GCM traffic is pointed at a per-run host the page cannot know (flags below)
        if line != SELFTEST.decode():
            (state["browser"] if internal in line else bucket["rec"]["canary"]).append(line[:300])
        try:
            conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        except OSError:
            pass
        conn.close()


threading.Thread(target=serve_canary, daemon=True).start()
try:  # chromedriver and Chromium talk over loopback: bwrap brings `lo` up in its network namespace, unshare does not
    with socket.create_connection(canary.getsockname(), timeout=5) as probe_conn:
        probe_conn.sendall(SELFTEST + b"\r\n")
except OSError as exc:
    emit({"setup_failed": "loopback is not usable in this sandbox (%s): coding.webdev needs the bwrap backend, whose "
                          "network namespace has `lo` up (the unshare backend leaves it down)" % (exc,)})
    os._exit(0)

with open("/tmp/fonts.conf", "w") as fh:
    fh.write('<?xml version="1.0"?><!DOCTYPE fontconfig SYSTEM "fonts.dtd"><fontconfig>'
             '<dir>/usr/share/fonts</dir><cachedir>/tmp/fontconfig</cachedir>'
             '<alias><family>sans-serif</family><prefer><family>DejaVu Sans</family></prefer></alias>'
             '<alias><family>serif</family><prefer><family>DejaVu Serif</family></prefer></alias>'
             '<alias><family>monospace</family><prefer><family>DejaVu Sans Mono</family></prefer></alias>'
             '</fontconfig>')
os.environ.update({"FONTCONFIG_FILE": "/tmp/fonts.conf", "HOME": "/tmp/home", "XDG_CONFIG_HOME": "/tmp/home/.config",
                   "XDG_CACHE_HOME": "/tmp/home/.cache"})
os.makedirs("/tmp/home", exist_ok=True)

try:
    from selenium import webdriver
    from selenium.common.exceptions import TimeoutException, WebDriverException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.remote.remote_connection import RemoteConnection

    RemoteConnection.set_timeout(T["start"])
    opts = webdriver.ChromeOptions()
    opts.binary_location = cfg["chromium"]
    w, h = cfg["viewport"]
    quiet = ("NetworkTimeServiceQuerying,OptimizationHints,OptimizationGuideModelDownloading,MediaRouter,"
             "DialMediaRouteProvider,Translate,AutofillServerCommunication,CertificateTransparencyComponentUpdater,"
             "InterestFeedContentSuggestions,PreconnectToSearch,SearchPrefetchServicePrefetching,NtpOneGoogleBar,"
             "AimEnabled,AimEligibilityService,AimServerEligibilityEnabled,AimServerRequestOnStartupEnabled")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=%d,%d" % (w, h), "--force-device-scale-factor=1", "--hide-scrollbars",
                "--user-data-dir=/tmp/profile", "--proxy-server=http://127.0.0.1:%d" % canary.getsockname()[1],
                "--proxy-bypass-list=<-loopback>", "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
                "--js-flags=--max-old-space-size=512", "--disable-features=" + quiet,
                "--disable-extensions", "--disable-sync", "--disable-default-apps", "--no-first-run",
                "--no-default-browser-check", "--disable-background-networking", "--disable-component-update",
                "--disable-domain-reliability", "--disable-client-side-phishing-detection", "--no-pings",
                "--metrics-recording-only", "--disable-breakpad", "--disable-search-engine-choice-screen",
                "--mute-audio", "--font-render-hinting=none", "--force-color-profile=srgb",
                "--gcm-checkin-url=http://%s/checkin" % internal, "--gcm-registration-url=http://%s/register" % internal,
                "--gcm-mcs-endpoint=http://%s:5228" % internal):
        opts.add_argument(arg)
    opts.add_experimental_option("prefs", {
        "session.restore_on_startup": 4, "session.startup_urls": ["about:blank"], "homepage": "about:blank",
        "homepage_is_newtabpage": False, "default_search_provider": {"enabled": False},
        "net": {"network_prediction_options": 2}, "browser.enable_spellchecking": False,
        "spellcheck.dictionaries": [], "spellcheck.dictionary": "", "spellcheck.use_spelling_service": False})
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    opts.add_experimental_option("perfLoggingPrefs", {"enableNetwork": True, "enablePage": False})
    opts.set_capability("unhandledPromptBehavior", "dismiss")
    opts.set_capability("pageLoadStrategy", "normal")
    drv = webdriver.Chrome(service=Service(cfg["chromedriver"]), options=opts)
    RemoteConnection.set_timeout(T["command"])
    executor = drv.command_executor
    if hasattr(executor, "_get_connection_manager"):  # selenium 4.8 (Debian 12) fixes the timeout per connection pool
        executor._conn = executor._get_connection_manager()
    else:
        state["startup"]["console"].append("k3post: the command timeout stays at the start timeout")
    drv.set_page_load_timeout(T["load"])
    drv.set_script_timeout(T["command"])
    drv.implicitly_wait(0)
    drv.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                        {"width": w, "height": h, "deviceScaleFactor": 1, "mobile": False})
    # RTCPeerConnection does not go through the proxy: constructing one is a network attempt, reported on the console
    drv.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": """(() => {
      const report = console.error.bind(console);
      for (const name of ["RTCPeerConnection", "webkitRTCPeerConnection"]) {
        if (!(name in window)) continue;
        const stub = function () { report("k3post-network-attempt: " + name); throw new DOMException("no network", "NotAllowedError"); };
        Object.defineProperty(window, name, {value: stub, writable: false, configurable: false});
      }
    })();"""})
except Exception:
    emit({"setup_failed": traceback.format_exc()[-3000:]})
    os._exit(0)
up["ready"] = True
emit({"ready": time.monotonic() - t_start})

PROBES_JS = cfg["probes"]
OK_SCHEMES = ("file:", "data:", "blob:", "about:", "chrome-error:", "devtools:")


def drain_logs(rec):
    for e in drv.get_log("browser"):
        if e.get("level") == "SEVERE":
            rec["console"].append(str(e.get("message", ""))[:500])
    for e in drv.get_log("performance"):
        msg = json.loads(e["message"])["message"]
        m, p = msg.get("method"), msg.get("params", {})
        if m == "Network.requestWillBeSent":
            url = p.get("request", {}).get("url", "")
            if not url.startswith(OK_SCHEMES):
                rec["network"].append("request " + url[:300])
        elif m == "Network.webSocketCreated":
            rec["network"].append("websocket " + p.get("url", "")[:300])


def probe(name, args, settle=True):
    """Run PROBES[name](args) in a fresh isolated world of the main frame; a call that fails fast (the page was
    navigating: a form submitted without preventDefault, a reload) is retried once on the new document."""
    for attempt in (0, 1):
        t0 = time.monotonic()
        try:
            return _probe_once(name, args, settle)
        except (TimeoutException, WebDriverException):
            if attempt or time.monotonic() - t0 > 1.0:
                raise
            time.sleep(0.3)


def _probe_once(name, args, settle):
    frame = drv.execute_cdp_cmd("Page.getFrameTree", {})["frameTree"]["frame"]["id"]
    ctx = drv.execute_cdp_cmd("Page.createIsolatedWorld", {"frameId": frame, "worldName": "k3post-verifier"})["executionContextId"]
    # one animation frame and a task after the last action, then read the DOM
    wait = "await new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)));" if settle else ""
    expr = ("(async () => {" + PROBES_JS + ";" + wait + " return JSON.stringify(PROBES[%s](%s)); })()"
            % (json.dumps(name), json.dumps(args)))
    r = drv.execute_cdp_cmd("Runtime.evaluate", {"expression": expr, "contextId": ctx, "returnByValue": True,
                                                 "awaitPromise": True, "timeout": int(T["command"] * 1000)})
    if "exceptionDetails" in r:
        raise RuntimeError("probe %s failed: %s" % (name, json.dumps(r["exceptionDetails"])[:500]))
    return json.loads(r["result"]["value"])


def find(sel):
    els = drv.find_elements(By.CSS_SELECTOR, sel)
    if not els:
        raise LookupError("no element matches %s" % sel)
    return els[0]


def item_target(step):
    """The `target` inside the `occurrence`-th shown item of `items` whose `text_sel` text is `text`: found in the
    isolated world (the page's own query functions are not trusted), marked with a one-off attribute, then fetched."""
    mark = os.urandom(6).hex()
    found = probe("mark", {"items": step["items"], "text": step["text"], "text_sel": step["text_sel"],
                           "occurrence": step["occurrence"], "target": step["target"], "mark": mark}, settle=False)
    if found != "ok":
        raise LookupError(found)
    els = drv.find_elements(By.CSS_SELECTOR, '[data-k3post-target="%s"]' % mark)
    if len(els) != 1:
        raise LookupError("the item to click changed before the click")
    return els[0]


def screenshot():
    shot = drv.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "fromSurface": True})
    return shot["data"]


def do_step(step, obs):
    op = step["op"]
    if op == "type":
        find(step["sel"]).send_keys(step["text"])
    elif op == "clear":  # select all, delete: input events like a user's (element.clear() sends none)
        find(step["sel"]).send_keys(Keys.CONTROL, "a", Keys.NULL, Keys.DELETE)
    elif op == "click":
        find(step["sel"]).click()
    elif op == "enter":
        find(step["sel"]).send_keys(Keys.ENTER)
    elif op == "click_item":
        item_target(step).click()
    elif op == "observe":
        st = probe(step["probe"], step["args"])
        obs.append({"probe": step["probe"], "state": st})
        if st.get("missing"):  # the spec's elements are not there: every later check would fail too
            raise LookupError("missing elements: " + ", ".join(st["missing"][:6]))
    elif op == "layout":
        obs.append({"probe": "layout", "state": probe("layout", step["args"]), "png": screenshot()})
    else:
        raise ValueError("unknown step %r" % op)


prev = state["startup"]
for run in cfg["runs"]:
    rec = {"id": run["id"], "obs": [], "error": None, "step": None, "console": [], "network": [], "canary": [],
           "times": {}}
    state["runs"].append(rec)
    state["active"] = run["id"]
    try:
        drv.get("about:blank")  # the previous page's unload (beacons, errors) is still the previous page's
        drv.execute_cdp_cmd("Storage.clearDataForOrigin", {"origin": "file://", "storageTypes": "all"})
        drain_logs(prev)
        base = run["dir"]
        for path, text in run.get("files", {}).items():
            full = os.path.join(base, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as fh:
                fh.write(text)
        bucket["rec"] = prev = rec
        if not os.path.isfile(os.path.join(base, run["page"])):
            rec["error"], rec["step"] = "no %s in the working directory" % run["page"], -1
        else:
            t0 = time.monotonic()
            drv.get("file://" + os.path.join(base, run["page"]))
            rec["times"]["load"] = time.monotonic() - t0
            for i, step in enumerate(run["steps"]):
                rec["step"] = i
                t0 = time.monotonic()
                do_step(step, rec["obs"])
                rec["times"][step["op"]] = rec["times"].get(step["op"], 0.0) + time.monotonic() - t0
            rec["step"] = None
    except TimeoutException as exc:
        rec["error"] = "timeout: " + (str(exc).strip().splitlines() or ["a WebDriver command timed out"])[0][:300]
        finish("timeout", rec["error"])
    except Exception as exc:  # an action the page did not support: this run fails
        text = str(exc).strip().splitlines()
        rec["error"] = type(exc).__name__ + ": " + (text[0][:400] if text else "")
        if "timed out" in rec["error"].lower() or "timeout" in type(exc).__name__.lower():
            finish("timeout", rec["error"])
    try:
        drain_logs(rec)
    except Exception as exc:
        finish("timeout", "the browser stopped answering: %s" % (str(exc).strip().splitlines() or [""])[0][:300])
    if cfg["stop_on_error"] and (rec["error"] or rec["console"] or rec["network"] or rec["canary"]):
        break
try:
    drv.get("about:blank")
    time.sleep(0.05)  # late connections of the last page
    drain_logs(prev)
except Exception:
    pass
state.pop("active", None)
finish()
'''


# --------------------------------------------------------------------------- host side


@dataclass
class BrowserResult:
    """What one browser run reported (see the module docstring).

    Attributes:
        runs: per run ``{"id", "obs": [{"probe", "state", "png"?}], "error", "step", "console", "network",
            "canary"}``: SEVERE console entries, network attempts seen by the page's target and request lines of
            connections that reached the canary proxy, each attributed to the page that was loaded (a page's unload
            is still that page's).
        startup: the same three lists for the browser's start, before any page.
        browser: connections of the browser's own GCM client (pointed at a per-run host the page cannot know).
        error: ``"timeout"`` / ``"memory"`` / ``"crash"`` when the browser run as a whole failed.
        active: the id of the run that was under way when it failed.
        why: details of ``error``.
        seconds: the driver's wall time; ``ready_s``: until the browser was up.
        peak_rss: the largest summed resident memory of the sandbox's processes the watchdog saw (bytes).
        weak_isolation: the sandbox ran with rlimits only.
    """

    runs: list[dict[str, Any]] = field(default_factory=list)
    startup: dict[str, list[str]] = field(default_factory=dict)
    browser: list[str] = field(default_factory=list)
    error: str | None = None
    active: str | None = None
    why: str = ""
    seconds: float = 0.0
    ready_s: float = 0.0
    peak_rss: int = 0
    weak_isolation: bool = False


def network_attempts(rec: Mapping[str, Any]) -> list[str]:
    """A run's network attempts: the page target's requests and WebSockets, canary connections, RTCPeerConnection."""
    rtc = [c for c in rec.get("console", ()) if "k3post-network-attempt" in c]
    return [*rec.get("network", ()), *("connection: " + c for c in rec.get("canary", ())), *rtc]


def console_errors(rec: Mapping[str, Any]) -> list[str]:
    """A run's SEVERE console entries other than the network-attempt reports."""
    return [c for c in rec.get("console", ()) if "k3post-network-attempt" not in c]


def run_browser(files: Mapping[str, str], runs: Sequence[Mapping[str, Any]], *, stop_on_error: bool = True,
                timeouts: Mapping[str, float] | None = None, wall_s: float | None = None,
                memory_cap: int = MEMORY_CAP) -> BrowserResult:
    """Run the driver in a fresh sandbox holding ``files`` and play ``runs``; raise when the browser cannot start.

    Each run is ``{"id", "page": "index.html", "dir": "/sandbox", "files": {path: text} (written into ``dir`` just
    before the page loads), "steps": [...]}``. Steps: ``type`` / ``clear`` / ``click`` / ``enter`` (``sel``),
    ``click_item`` (``items``, ``text_sel``, ``text``, ``occurrence``, ``target``), ``observe`` (``probe``, ``args``)
    and ``layout`` (``args``: ``items``).

    Raises:
        BrowserUnavailableError: the stack is not installed or the browser did not start (never the page's fault).
    """
    missing = browser_available()
    if missing is not None:
        raise BrowserUnavailableError(f"coding.webdev needs headless Chromium: {missing}")
    tmo = {**DRIVER_TIMEOUTS, **(timeouts or {})}
    nonce = uuid.uuid4().hex
    cfg = {"nonce": nonce, "timeouts": tmo, "viewport": list(VIEWPORT), "chromium": CHROMIUM,
           "chromedriver": CHROMEDRIVER, "memory_cap": memory_cap, "probes": PROBES, "stop_on_error": stop_on_error,
           "runs": [dict(r) for r in runs]}
    limits = BROWSER_LIMITS if wall_s is None else dataclasses.replace(BROWSER_LIMITS, wall_s=wall_s)
    with Sandbox(limits=limits) as sb:
        for path, text in files.items():
            sb.write_file(path, text)
        res = sb.run([SYSTEM_PYTHON, "-I", "-B", "-c", DRIVER], stdin=json.dumps(cfg), timeout=limits.wall_s)
        weak = sb.weak_isolation
        stragglers = sb.wait_gone()  # no browser process outlives the call
    if stragglers:
        warnings.warn(f"coding.webdev: {stragglers} browser processes were still alive 5 s after the run; killed",
                      RuntimeWarning, stacklevel=2)
    ready: dict[str, Any] | None = None
    final: dict[str, Any] | None = None
    for line in res.stdout.splitlines():
        if not line.startswith(nonce + " "):
            continue
        try:
            obj = json.loads(line[len(nonce) + 1:])
        except json.JSONDecodeError:
            continue
        if "setup_failed" in obj:
            raise BrowserUnavailableError(f"headless Chromium did not start in the sandbox: {obj['setup_failed']}")
        if "ready" in obj:
            ready = obj
        elif "runs" in obj:
            final = obj
    if ready is None:
        why = res.killed_reason or f"exit code {res.returncode}"
        raise BrowserUnavailableError(f"the browser driver did not come up ({why}); stderr: {res.stderr[-1500:]}")
    if final is None:  # the browser was up, then the whole run died (killed at the wall clock, or crashed)
        why = res.killed_reason or f"exit code {res.returncode}"
        return BrowserResult(error="timeout" if res.timed_out else "crash", why=f"the browser run ended without a "
                             f"report ({why}); stderr: {res.stderr[-500:]}", ready_s=float(ready["ready"]),
                             weak_isolation=weak)
    return BrowserResult(runs=final["runs"], startup=final["startup"], browser=final["browser"], error=final.get("error"),
                         active=final.get("active"), why=final.get("why", ""), seconds=float(final["seconds"]),
                         ready_s=float(ready["ready"]), peak_rss=int(final.get("peak_rss", 0)), weak_isolation=weak)


# --------------------------------------------------------------------------- the layout metric


def ink_pixels(png_b64: str, boxes: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Per box key: pixels in the box (1 px inset) whose colour differs from the box's most common colour by at
    least `INK_CONTRAST` in some channel, i.e. painted text / marks that stand out of their background."""
    from PIL import Image

    img = Image.open(io.BytesIO(base64.b64decode(png_b64))).convert("RGB")
    out: dict[str, int] = {}
    for b in boxes:
        if b.get("missing"):
            continue
        x0, y0 = max(0, int(b["x"]) + 1), max(0, int(b["y"]) + 1)
        x1, y1 = min(img.width, int(b["x"] + b["w"]) - 1), min(img.height, int(b["y"] + b["h"]) - 1)
        if x1 <= x0 or y1 <= y0:
            out[b["key"]] = 0
            continue
        crop = img.crop((x0, y0, x1, y1))
        colors = crop.getcolors(maxcolors=crop.width * crop.height) or []
        bg = max(colors)[1] if colors else (255, 255, 255)
        out[b["key"]] = sum(n for n, c in colors if max(abs(c[k] - bg[k]) for k in range(3)) >= INK_CONTRAST)
    return out


def _rel(kind: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    s = BOX_SLACK
    if kind == "above":  # a ends before b starts, vertically
        return a["y"] + a["h"] <= b["y"] + s
    if kind == "left":
        return a["x"] + a["w"] <= b["x"] + s
    if kind == "line":  # vertical extents overlap by half the smaller height
        ov = min(a["y"] + a["h"], b["y"] + b["h"]) - max(a["y"], b["y"])
        return ov >= 0.5 * min(a["h"], b["h"]) - s
    if kind == "column":  # horizontal extents overlap
        return min(a["x"] + a["w"], b["x"] + b["w"]) - max(a["x"], b["x"]) > 0
    raise ValueError(f"unknown relation {kind!r}")


def layout_failures(agent: Mapping[str, Any], agent_png: str, reference: Mapping[str, Any], reference_png: str,
                    relations: Sequence[tuple[str, str, str]]) -> list[str]:
    """What the agent's rendering gets wrong against the reference rendering of the same state (empty: passes).

    Per key element present in the reference rendering: the agent's must exist, be shown (``checkVisibility`` with
    opacity and visibility), have an area of at least 4 px, lie inside the `VIEWPORT` window, be the element hit at
    its centre (nothing covers it), and for text elements hold at least `MIN_INK` ink pixels in the screenshot
    (`ink_pixels`). Then every relation ``(kind, key_a, key_b)`` (``above``, ``left``, ``line``, ``column``) that
    holds in the reference rendering must hold in the agent's (`BOX_SLACK` px of tolerance). Relations that do not
    hold in the reference are a calibration error (ValueError): the spec promised them.
    """
    ref = {b["key"]: b for b in reference["boxes"] if not b.get("missing") and b["shown"] and b["w"] * b["h"] >= 4}
    got = {b["key"]: b for b in agent["boxes"]}
    ink_ref = ink_pixels(reference_png, list(ref.values()))
    ink = ink_pixels(agent_png, [b for b in got.values() if not b.get("missing")])
    w, h = agent["width"], agent["height"]
    bad: list[str] = []
    for key, rb in ref.items():
        if rb["text"] and ink_ref.get(key, 0) < MIN_INK:
            raise ValueError(f"layout calibration: the reference rendering shows no ink in {key} (fonts missing?)")
        b = got.get(key)
        if b is None or b.get("missing"):
            bad.append(f"{key}: missing")
            continue
        if not b["shown"] or b["w"] * b["h"] < 4:
            bad.append(f"{key}: not shown ({b['w']:.0f}x{b['h']:.0f} px)")
            continue
        if b["x"] < -BOX_SLACK or b["y"] < -BOX_SLACK or b["x"] + b["w"] > w + BOX_SLACK or b["y"] + b["h"] > h + BOX_SLACK:
            bad.append(f"{key}: outside the {w}x{h} window at ({b['x']:.0f}, {b['y']:.0f}) {b['w']:.0f}x{b['h']:.0f}")
            continue
        if not b["hit"]:
            bad.append(f"{key}: covered by another element at its centre")
        if rb["text"] and b["text"] and ink.get(key, 0) < MIN_INK:
            bad.append(f"{key}: no visible text in the screenshot ({ink.get(key, 0)} ink pixels)")
    for kind, ka, kb in relations:
        if ka not in ref or kb not in ref:
            continue
        if not _rel(kind, ref[ka], ref[kb]):
            raise ValueError(f"layout calibration: the reference rendering breaks {kind}({ka}, {kb})")
        a, b = got.get(ka), got.get(kb)
        if a is None or b is None or a.get("missing") or b.get("missing"):
            continue  # reported above
        if not _rel(kind, a, b):
            bad.append(f"{ka} must be {_WORDS[kind]} {kb}")
    return bad


_WORDS = {"above": "above", "left": "left of", "line": "on one line with", "column": "in the column of"}
