"""The page specs of ``coding.webdev``: a form with validation, a todo list, a sortable table.

Each kind provides, from a JSON-able ``spec`` dict drawn per seed (element ids, field names and rules, counter
wording, columns, sort and filter rules):

* ``prompt(spec)``: the precise contract (ids, behaviour, layout) the agent's page must meet;
* ``reference(spec, style)``: a complete page (``index.html``, ``style.css``, ``app.js``) meeting it; ``style``
  ``"plain"`` is the reference solver's, ``"alt"`` an independent restyling (dark theme, other fonts, flexbox /
  grid, other spacing) that must score 1 too, so the layout check does not reward one stylesheet;
* ``scenarios(spec, rng)``: scripted interactions (type, click, press Enter, toggle, delete, sort, filter) with
  values drawn from ``rng`` (the hidden seed at verification, the public seed for the ``preview`` tool), each
  ``observe`` step paired with the expected DOM state, which stays on the host;
* ``check(spec, expect, state)``: the first mismatch between an expected and an observed state, in words;
* ``layout(spec)``: the key elements and the relations (``above`` / ``left`` / ``line`` / ``column``) the
  layout metric compares with the reference rendering (`browser.layout_failures`);
* ``hacks(spec, public)``: adversarial pages that fake the checked state, ignore inputs or break the layout.

Values compared with the page are whitespace-normalised (runs of whitespace to one space, trimmed).
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["KINDS", "js_number", "norm"]


def norm(s: Any) -> str:
    """Runs of whitespace to one space, trimmed (what the verifier's probes do to text)."""
    return " ".join(str(s).split())


def js_number(v: float | int) -> str:
    """``String(v)`` in JavaScript for the values the tables use (integers, |v| < 1e7 with at most 2 decimals)."""
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


_TIMING = ("The page is checked one animation frame after each action: update the DOM in the event handlers "
           "(no delays or debouncing). ")
_PREFIXES = ("app", "main", "ui", "demo", "page", "box", "pane", "shop", "crm", "desk", "lab", "hub")


def _prefix(rng: random.Random) -> str:
    return f"{rng.choice(_PREFIXES)}{rng.randrange(10, 100)}"


def _word(rng: random.Random, lo: int = 4, hi: int = 8) -> str:
    cons, vows = "bcdfghjklmnprstvwz", "aeiou"
    n = rng.randint(lo, hi)
    return "".join(rng.choice(cons if i % 2 == 0 else vows) for i in range(n))


# shared by the three kinds' pages ------------------------------------------------------------------------------

_PLAIN_CSS = """* { box-sizing: border-box; }
body { font-family: "DejaVu Sans", sans-serif; font-size: 16px; color: #1d2330; background: #ffffff; margin: 0; }
main { max-width: 720px; margin: 24px auto; padding: 0 16px; }
h1 { font-size: 24px; margin: 0 0 16px; }
button { font: inherit; padding: 4px 12px; border: 1px solid #5b6475; border-radius: 4px; background: #eef1f6; color: #1d2330; cursor: pointer; }
input[type=text], input[type=password] { font: inherit; padding: 4px 8px; border: 1px solid #5b6475; border-radius: 4px; color: #1d2330; background: #fff; }
"""

_ALT_CSS = """html { background: #15171c; }
body { font-family: "Liberation Serif", serif; font-size: 19px; color: #f1e9d2; background: #15171c; margin: 40px 0 0 64px; line-height: 1.6; }
main { width: 560px; }
h1 { font-family: "DejaVu Sans Mono", monospace; font-size: 30px; letter-spacing: 2px; color: #ffcf5c; margin: 0 0 28px; }
button { font-family: "DejaVu Sans Mono", monospace; font-size: 15px; padding: 8px 18px; border: 2px solid #ffcf5c; background: #2a2d36; color: #ffcf5c; text-transform: uppercase; }
input[type=text], input[type=password] { font: inherit; padding: 8px 10px; border: 0; border-bottom: 2px solid #ffcf5c; background: #22252d; color: #ffffff; }
"""


def _html(title: str, body: str, *, scripts: Sequence[str] = ("app.js",)) -> str:
    tags = "\n".join(f'<script src="{s}"></script>' for s in scripts)
    return (f'<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{_esc(title)}</title>\n'
            f'<link rel="stylesheet" href="style.css">\n</head>\n<body>\n<main>\n<h1>{_esc(title)}</h1>\n{body}\n</main>\n'
            f"{tags}\n</body>\n</html>\n")


def _obs(probe: str, args: Mapping[str, Any]) -> dict[str, Any]:
    return {"op": "observe", "probe": probe, "args": dict(args)}


# =========================================================================== form with validation

_FIELD_NAMES = {
    "username": ("username", "user", "handle", "login"),
    "fullname": ("fullname", "name", "full-name"),
    "email": ("email", "mail", "email-address"),
    "age": ("age", "years"),
    "zip": ("zip", "postcode", "postal"),
    "password": ("password", "pass", "pwd"),
    "confirm": ("confirm", "password2", "repeat"),
    "quantity": ("quantity", "qty", "amount"),
    "phone": ("phone", "tel", "mobile"),
    "website": ("website", "homepage", "url"),
}
_FIELD_LABELS = {"username": "Username", "fullname": "Full name", "email": "Email", "age": "Age", "zip": "ZIP code",
                 "password": "Password", "confirm": "Confirm password", "quantity": "Quantity", "phone": "Phone",
                 "website": "Website"}
_FORM_TITLES = ("Create an account", "Sign up", "Join the club", "Register", "Order form", "Membership")
_SUBMITS = ("Submit", "Sign up", "Register", "Send", "Create")


_RULE_TEXT = {
    "username": "{min} to {max} characters, each a letter A-Z / a-z, a digit or an underscore",
    "fullname": "at least two words (separated by spaces)",
    "email": "matches the regular expression ^[^\\s@]+@[^\\s@]+\\.[^\\s@]+$",
    "age": "digits only, a whole number from {lo} to {hi}",
    "zip": "exactly {n} digits",
    "password": "at least {min} characters, with at least one letter (A-Z / a-z) and at least one digit",
    "confirm": "equal to the password field (#{password_id})",
    "quantity": "digits only, a whole number from 1 to {max}",
    "phone": "only digits, spaces and dashes, with 7 to 12 digits in all",
    "website": "starts with https:// and matches ^https://[^\\s/]+\\.\\S+$",
}


def _rule_text(f: Mapping[str, Any], fields: Sequence[Mapping[str, Any]]) -> str:
    pw = next((x["id"] for x in fields if x["kind"] == "password"), "")
    r = _RULE_TEXT[f["kind"]].format(**f["args"], password_id=pw)
    return ("optional: empty is valid, otherwise " if f["optional"] else "required: ") + r


def _valid(f: Mapping[str, Any], v: str, values: Mapping[str, str]) -> bool:
    """Whether the trimmed value ``v`` of field ``f`` is valid (``values``: every field's trimmed value, by kind)."""
    k, a = f["kind"], f["args"]
    if f["optional"] and v == "":
        return True
    if k == "username":
        return a["min"] <= len(v) <= a["max"] and re.fullmatch(r"[A-Za-z0-9_]+", v) is not None
    if k == "fullname":
        return len(v.split()) >= 2
    if k == "email":
        return re.fullmatch(r"[^\s@]+@[^\s@]+\.[^\s@]+", v) is not None
    if k == "age":
        return re.fullmatch(r"[0-9]+", v) is not None and a["lo"] <= int(v) <= a["hi"]
    if k == "zip":
        return re.fullmatch(r"[0-9]{%d}" % a["n"], v) is not None
    if k == "password":
        return len(v) >= a["min"] and re.search(r"[0-9]", v) is not None and re.search(r"[A-Za-z]", v) is not None
    if k == "confirm":
        return v != "" and v == values.get("password")
    if k == "quantity":
        return re.fullmatch(r"[0-9]+", v) is not None and 1 <= int(v) <= a["max"]
    if k == "phone":
        return re.fullmatch(r"[0-9 -]+", v) is not None and 7 <= sum(c.isdigit() for c in v) <= 12
    if k == "website":
        return re.fullmatch(r"https://[^\s/]+\.\S+", v) is not None
    raise ValueError(k)


_JS_RULES = {
    "username": "v => v.length >= {min} && v.length <= {max} && /^[A-Za-z0-9_]+$/.test(v)",
    "fullname": "v => v.split(/\\s+/).filter(Boolean).length >= 2",
    "email": "v => /^[^\\s@]+@[^\\s@]+\\.[^\\s@]+$/.test(v)",
    "age": "v => /^[0-9]+$/.test(v) && Number(v) >= {lo} && Number(v) <= {hi}",
    "zip": "v => /^[0-9]{{{n}}}$/.test(v)",
    "password": "v => v.length >= {min} && /[0-9]/.test(v) && /[A-Za-z]/.test(v)",
    "confirm": "(v, all) => v !== '' && v === all.password",
    "quantity": "v => /^[0-9]+$/.test(v) && Number(v) >= 1 && Number(v) <= {max}",
    "phone": "v => /^[0-9 -]+$/.test(v) && (v.match(/[0-9]/g) || []).length >= 7 && (v.match(/[0-9]/g) || []).length <= 12",
    "website": "v => /^https:\\/\\/[^\\s/]+\\.\\S+$/.test(v)",
}
_JS_MESSAGES = {
    "username": "Use {min}-{max} letters, digits or _.", "fullname": "Enter your first and last name.",
    "email": "Enter a valid email address.", "age": "Enter a whole number from {lo} to {hi}.",
    "zip": "Enter exactly {n} digits.", "password": "At least {min} characters with a letter and a digit.",
    "confirm": "The passwords do not match.", "quantity": "Enter a whole number from 1 to {max}.",
    "phone": "Enter 7 to 12 digits (spaces and dashes allowed).", "website": "Enter an https:// address.",
}


def _rand_chars(rng: random.Random, n: int, alphabet: str) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


_ALNUM = string.ascii_letters + string.digits


def _valid_value(f: Mapping[str, Any], rng: random.Random, values: Mapping[str, str]) -> str:
    """A valid raw value of field ``f`` (sometimes at a boundary, sometimes padded with spaces)."""
    k, a = f["kind"], f["args"]
    if k == "username":
        n = rng.choice([a["min"], a["max"], rng.randint(a["min"], a["max"])])
        v = rng.choice(string.ascii_letters) + _rand_chars(rng, n - 1, _ALNUM + "_")
    elif k == "fullname":
        v = f"{_word(rng, 3, 6).capitalize()} {_word(rng, 4, 8).capitalize()}"
        if rng.random() < 0.3:
            v += " " + _word(rng, 3, 6).capitalize()
    elif k == "email":
        v = f"{_word(rng, 3, 7)}{rng.choice(['', '.', '_'])}{rng.randrange(100)}@{_word(rng, 4, 7)}.{rng.choice(['com', 'org', 'net', 'io', 'de'])}"
    elif k == "age":
        v = str(rng.choice([a["lo"], a["hi"], rng.randint(a["lo"], a["hi"])]))
    elif k == "zip":
        v = _rand_chars(rng, a["n"], string.digits)
    elif k == "password":
        n = rng.choice([a["min"], a["min"] + rng.randint(1, 6)])
        v = rng.choice(string.ascii_letters) + rng.choice(string.digits) + _rand_chars(rng, n - 2, _ALNUM + "!#%")
        v = "".join(rng.sample(v, len(v)))
    elif k == "confirm":
        v = values["password"]
    elif k == "quantity":
        v = str(rng.choice([1, a["max"], rng.randint(1, a["max"])]))
    elif k == "phone":
        d = _rand_chars(rng, rng.randint(7, 12), string.digits)
        v = d if rng.random() < 0.4 else f"{d[:3]}{rng.choice([' ', '-'])}{d[3:]}"
    elif k == "website":
        v = "" if f["optional"] and rng.random() < 0.3 else f"https://{_word(rng)}.{rng.choice(['com', 'org', 'dev'])}/{_word(rng, 3, 5)}"
    else:  # pragma: no cover
        raise ValueError(k)
    if k not in ("confirm", "password") and v and rng.random() < 0.25:
        v = " " * rng.randint(1, 2) + v + " " * rng.randint(0, 2)  # surrounding spaces are trimmed before validation
    return v


def _invalid_value(f: Mapping[str, Any], rng: random.Random, values: Mapping[str, str]) -> str:
    """An invalid raw value of field ``f`` (for optional fields, never the empty string)."""
    k, a = f["kind"], f["args"]
    opts: list[str]
    if k == "username":
        opts = [_rand_chars(rng, a["min"] - 1, string.ascii_letters), "a" + _rand_chars(rng, a["max"], _ALNUM),
                _word(rng, 3, 4) + rng.choice(["-", " ", "!", ".", "é"]) + _word(rng, 2, 3)]
    elif k == "fullname":
        opts = [_word(rng, 3, 8).capitalize(), f"  {_word(rng, 4, 6).capitalize()}  "]
    elif k == "email":
        w = _word(rng, 3, 6)
        opts = [f"{w}@{_word(rng, 4, 6)}", f"{w}.{_word(rng, 4, 6)}.com", f"{w}@@{_word(rng)}.com", f"{w} x@{_word(rng)}.org",
                f"@{_word(rng)}.com"]
    elif k == "age":
        opts = [str(a["lo"] - rng.randint(1, 5)), str(a["hi"] + rng.randint(1, 30)), f"{rng.randint(a['lo'], a['hi'])}.5",
                _word(rng, 3, 5), f"-{rng.randint(a['lo'], a['hi'])}"]
    elif k == "zip":
        opts = [_rand_chars(rng, a["n"] - 1, string.digits), _rand_chars(rng, a["n"] + 1, string.digits),
                _rand_chars(rng, a["n"] - 1, string.digits) + rng.choice("abcxyz")]
    elif k == "password":
        opts = [_rand_chars(rng, a["min"] - 2, string.ascii_letters) + "7",  # one character short
                _rand_chars(rng, a["min"] + 2, string.ascii_letters), _rand_chars(rng, a["min"] + 2, string.digits)]
    elif k == "confirm":
        pw = values.get("password", "")
        opts = [pw + rng.choice("xyz1"), pw[:-1] if len(pw) > 1 else "mismatch9"]
    elif k == "quantity":
        opts = ["0", str(a["max"] + rng.randint(1, 9)), f"{rng.randint(1, a['max'])}x", "-1"]
    elif k == "phone":
        opts = [_rand_chars(rng, rng.randint(3, 6), string.digits), _rand_chars(rng, 13, string.digits),
                f"{_rand_chars(rng, 4, string.digits)}.{_rand_chars(rng, 4, string.digits)}", f"+{_rand_chars(rng, 9, string.digits)}"]
    elif k == "website":
        opts = [f"http://{_word(rng)}.com", f"{_word(rng)}.com", f"https://{_word(rng)}", f"https://{_word(rng)} .com"]
    else:  # pragma: no cover
        raise ValueError(k)
    for _ in range(20):
        v = rng.choice(opts)
        if v.strip() != "" and not _valid(f, v.strip(), values):
            return v
    raise AssertionError(f"no invalid value drawn for {k}")  # pragma: no cover


class FormKind:
    """A registration / order form validated in JavaScript on submit."""

    name = "form"

    def draw(self, rng: random.Random, difficulty: int) -> dict[str, Any]:
        p = _prefix(rng)
        ident = rng.choice(["username", "fullname"])
        pool = ["age", "zip", "quantity", "phone"]
        kinds = [ident, "email"]
        kinds += rng.sample(pool, 1 if difficulty == 1 else 2 if difficulty == 2 else 2)
        if difficulty == 3:
            kinds += ["password", "confirm"]
        optional: set[str] = set()
        if difficulty >= 2:
            extra = rng.choice(["website", "phone"]) if "phone" not in kinds else "website"
            kinds.append(extra)
            optional.add(extra)
        fields = []
        for k in kinds:
            args: dict[str, int] = {}
            if k == "username":
                args = {"min": rng.choice([3, 4, 5]), "max": rng.choice([10, 12, 16])}
            elif k == "age":
                args = {"lo": rng.choice([13, 16, 18, 21]), "hi": rng.choice([99, 110, 120])}
            elif k == "zip":
                args = {"n": rng.choice([4, 5, 6])}
            elif k == "password":
                args = {"min": rng.choice([8, 10, 12])}
            elif k == "quantity":
                args = {"max": rng.choice([5, 9, 12, 20, 50])}
            name = rng.choice(_FIELD_NAMES[k])
            fields.append({"kind": k, "name": name, "id": f"{p}-{name}", "error": f"{p}-{name}-error",
                           "label": _FIELD_LABELS[k], "args": args, "optional": k in optional,
                           "secret": k in ("password", "confirm")})
        ident_f = fields[0]
        who, mail = "{" + ident_f["name"] + "}", "{" + fields[1]["name"] + "}"  # placeholders: field names
        templates = [f"Thanks, {who}! We will write to {mail}.", f"Welcome aboard, {who}.",
                     f"Registered {who} ({mail}).", f"Saved: {who} <{mail}>"]
        return {"kind": "form", "prefix": p, "title": rng.choice(_FORM_TITLES), "fields": fields,
                "form": f"{p}-form", "submit": f"{p}-submit", "submit_label": rng.choice(_SUBMITS),
                "result": f"{p}-result", "template": rng.choice(templates)}

    # ------------------------------------------------------------------ prompt

    def prompt(self, spec: Mapping[str, Any], example: Mapping[str, Any]) -> str:
        f = spec["fields"]
        lines = [f"  {i + 1}. {x['label']}: <input id=\"{x['id']}\" type=\"{'password' if x['secret'] else 'text'}\"> with "
                 f"its error element #{x['error']}; valid when the trimmed value is {_rule_text(x, f)}."
                 for i, x in enumerate(f)]
        ok_vals = {k: norm(v) for k, v in example["valid"].items()}
        return (
            f"Build a web page \"{spec['title']}\": a form with client-side validation.\n\n"
            f"Write index.html (it may load local .css / .js files of the working directory). The page must contain "
            f"<form id=\"{spec['form']}\"> with these fields, in this order:\n" + "\n".join(lines) + "\n"
            f"then <button id=\"{spec['submit']}\" type=\"submit\">{spec['submit_label']}</button>, and after the form "
            f"an element #{spec['result']} for the result message.\n\n"
            "Behaviour. Submitting the form (clicking the button, or pressing Enter in a field) must not reload the page "
            "or show the browser's own validation bubbles. Validate every field's value with surrounding whitespace "
            "removed (trim) against its rule above:\n"
            "  - an invalid field: its error element shows a non-empty message and is visible, and its input gets "
            "aria-invalid=\"true\";\n"
            "  - a valid field: its error element is empty, and its input's aria-invalid is not \"true\";\n"
            f"  - if any field is invalid, #{spec['result']} is empty and the typed values stay in the inputs;\n"
            f"  - if all are valid, #{spec['result']} shows exactly \"{spec['template']}\" (each {{x}} replaced "
            f"by the trimmed value of the field #{spec['prefix']}-x) and every input is cleared.\n"
            "Every submit re-validates all fields (a corrected field's message disappears).\n\n"
            "Layout (checked on a screenshot in a 1024 x 1280 window, against a reference rendering): every field, "
            "error message, the button and the result visible inside the window, nothing covering them; the fields "
            "stacked vertically in the order above; each error message directly below its own input and above the "
            f"next field; the button below the fields; #{spec['result']} below the button.\n\n"
            + _TIMING + "Rules: no external resources or network requests of any kind (scripts, styles, fonts, images, fetch, "
            "WebSocket ...), no errors in the browser console, no alert() or other dialogs.\n\n"
            f"Example: {', '.join(f'{k} {v!r}' for k, v in ok_vals.items())} -> \"{_fill(spec['template'], spec, example['valid'])}\". "
            "Hidden tests type other values. Tools: write_file / read_file / list_files, and preview (loads your page in "
            "headless Chromium and runs the example checks). Reply without a tool call when you are done."
        )

    # ------------------------------------------------------------------ reference page

    def reference(self, spec: Mapping[str, Any], style: str = "plain") -> dict[str, str]:
        rows = []
        for x in spec["fields"]:
            t = "password" if x["secret"] else "text"
            rows.append(f'  <div class="field">\n    <label for="{x["id"]}">{_esc(x["label"])}'
                        f'{" <small>(optional)</small>" if x["optional"] else ""}</label>\n'
                        f'    <input id="{x["id"]}" name="{x["name"]}" type="{t}" autocomplete="off">\n'
                        f'    <div class="error" id="{x["error"]}" aria-live="polite"></div>\n  </div>')
        body = (f'<form id="{spec["form"]}" novalidate>\n' + "\n".join(rows) +
                f'\n  <button id="{spec["submit"]}" type="submit">{_esc(spec["submit_label"])}</button>\n</form>\n'
                f'<p id="{spec["result"]}" class="result" aria-live="polite"></p>')
        fields_js = ",\n".join(
            f'  {{id: {json.dumps(x["id"])}, error: {json.dumps(x["error"])}, kind: {json.dumps(x["kind"])}, '
            f'optional: {json.dumps(x["optional"])}, ok: {_JS_RULES[x["kind"]].format(**x["args"])}, '
            f'message: {json.dumps(_JS_MESSAGES[x["kind"]].format(**x["args"]))}}}' for x in spec["fields"])
        names = {x["name"]: x["kind"] for x in spec["fields"]}
        template = re.sub(r"\{([\w-]+)\}", lambda m: "${all." + names[m.group(1)] + "}", spec["template"].replace("`", "\\`"))
        js = f""""use strict";
const FIELDS = [
{fields_js}
];
const form = document.getElementById({json.dumps(spec["form"])});
const result = document.getElementById({json.dumps(spec["result"])});
form.addEventListener("submit", (event) => {{
  event.preventDefault();
  const all = {{}};
  for (const f of FIELDS) all[f.kind] = document.getElementById(f.id).value.trim();
  let valid = true;
  for (const f of FIELDS) {{
    const v = all[f.kind];
    const ok = (f.optional && v === "") || f.ok(v, all);
    const input = document.getElementById(f.id);
    document.getElementById(f.error).textContent = ok ? "" : f.message;
    input.setAttribute("aria-invalid", ok ? "false" : "true");
    if (!ok) valid = false;
  }}
  if (valid) {{
    result.textContent = `{template}`;
    form.reset();
  }} else {{
    result.textContent = "";
  }}
}});
"""
        css = (_PLAIN_CSS + """form { display: block; }
.field { margin-bottom: 12px; }
.field label { display: block; font-weight: bold; margin-bottom: 2px; }
.field input { width: 100%; }
.error { color: #b00020; font-size: 14px; min-height: 0; }
.result { margin-top: 16px; color: #0b6e2e; font-weight: bold; }
""") if style == "plain" else (_ALT_CSS + """form { display: grid; grid-template-columns: 1fr; row-gap: 22px; }
.field { display: flex; flex-direction: column; }
.field label { font-variant: small-caps; color: #9fb4ff; }
.field input { width: 420px; }
.error { color: #ff8a80; font-style: italic; padding-left: 8px; border-left: 3px solid #ff8a80; }
.error:empty { display: none; }
.result { margin-top: 30px; padding: 12px 16px; background: #23402c; color: #c8ffd4; }
.result:empty { display: none; }
""")
        return {"index.html": _html(spec["title"], body), "style.css": css, "app.js": js}

    # ------------------------------------------------------------------ scenarios

    def _args(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        return {"fields": [{"name": x["name"], "input": f"#{x['id']}", "error": f"#{x['error']}"} for x in spec["fields"]],
                "result": f"#{spec['result']}"}

    def _expect(self, spec: Mapping[str, Any], typed: Mapping[str, str]) -> dict[str, Any]:
        values = {x["kind"]: typed.get(x["name"], "").strip() for x in spec["fields"]}
        invalid = [x["name"] for x in spec["fields"] if not _valid(x, values[x["kind"]], values)]
        ok = not invalid
        return {"invalid": invalid, "result": _fill(spec["template"], spec, typed) if ok else "",
                "values": {x["name"]: ("" if ok else typed.get(x["name"], "")) for x in spec["fields"]}}

    def example(self, spec: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
        values: dict[str, str] = {}
        for x in spec["fields"]:
            v = _valid_value(x, rng, values).strip()
            if x["optional"] and v == "":
                v = _valid_value(x, rng, values).strip() or v
            values[x["kind"]] = v
        return {"valid": {x["name"]: values[x["kind"]] for x in spec["fields"]}}

    def _fill_all(self, spec: Mapping[str, Any], typed: Mapping[str, str]) -> list[dict[str, Any]]:
        return [{"op": "type", "sel": f"#{x['id']}", "text": typed[x["name"]]} for x in spec["fields"] if typed[x["name"]]]

    def _draw_values(self, spec: Mapping[str, Any], rng: random.Random, bad: set[str]) -> dict[str, str]:
        values: dict[str, str] = {}
        typed: dict[str, str] = {}
        for x in spec["fields"]:
            raw = _invalid_value(x, rng, values) if x["name"] in bad else _valid_value(x, rng, values)
            typed[x["name"]] = raw
            values[x["kind"]] = raw.strip()
        return typed

    def scenarios(self, spec: Mapping[str, Any], rng: random.Random, *, public: Mapping[str, Any] | None = None
                  ) -> list[dict[str, Any]]:
        a = self._args(spec)
        names = [x["name"] for x in spec["fields"]]
        submit = {"op": "click", "sel": f"#{spec['submit']}"}
        last_text = next(f"#{x['id']}" for x in reversed(spec["fields"]))
        out: list[dict[str, Any]] = []

        def observe(typed: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
            return _obs("form", a), self._expect(spec, typed)

        if public is not None:  # the prompt's example, then the same with the first field broken
            typed = dict(public["valid"])
            o, e = observe(typed)
            bad = dict(typed)
            bad[names[0]] = _invalid_value(spec["fields"][0], rng, {})
            o2, e2 = observe(bad)
            return [{"id": "example-valid", "steps": [*self._fill_all(spec, typed), submit, o], "expect": [e]},
                    {"id": "example-invalid", "steps": [*self._fill_all(spec, bad), submit, o2,
                                                        {"op": "layout", "args": self.layout_args(spec)}],
                     "expect": [e2], "layout": True}]
        # 1: all valid, submit by click
        typed = self._draw_values(spec, rng, set())
        o, e = observe(typed)
        out.append({"id": "valid", "steps": [*self._fill_all(spec, typed), submit, o], "expect": [e]})
        # 2: one or two invalid fields, then corrected and submitted with Enter in the last field
        bad = set(rng.sample(names, min(2, len(names))))
        typed = self._draw_values(spec, rng, bad)
        o1, e1 = observe(typed)
        steps = [*self._fill_all(spec, typed), submit, o1]
        fixed = dict(typed)
        values = {x["kind"]: typed[x["name"]].strip() for x in spec["fields"]}
        for x in spec["fields"]:
            if x["name"] in bad or (x["kind"] == "confirm" and not _valid(x, values["confirm"], values)):
                fixed[x["name"]] = _valid_value(x, rng, values).strip() if x["kind"] != "confirm" else values["password"]
                values[x["kind"]] = fixed[x["name"]].strip()
                steps += [{"op": "clear", "sel": f"#{x['id']}"}, {"op": "type", "sel": f"#{x['id']}", "text": fixed[x["name"]]}]
        o2, e2 = observe(fixed)
        steps += [{"op": "enter", "sel": last_text}, o2]
        out.append({"id": "invalid-then-fixed", "steps": steps, "expect": [e1, e2]})
        # 3: everything empty
        empty = {n: "" for n in names}
        o, e = observe(empty)
        out.append({"id": "empty", "steps": [submit, o], "expect": [e]})
        # 4: a different invalid mix (the layout scenario: errors shown, then the success message)
        rest = [n for n in names if n not in bad] or names
        bad2 = set(rng.sample(rest, min(len(rest), rng.randint(1, 3))))
        typed = self._draw_values(spec, rng, bad2)
        o1, e1 = observe(typed)
        steps = [*self._fill_all(spec, typed), submit, o1, {"op": "layout", "args": self.layout_args(spec)}]
        for x in spec["fields"]:
            steps.append({"op": "clear", "sel": f"#{x['id']}"})
        typed2 = self._draw_values(spec, rng, set())
        o2, e2 = observe(typed2)
        steps += [*self._fill_all(spec, typed2), submit, o2, {"op": "layout", "args": self.layout_args(spec)}]
        out.append({"id": "invalid-mix", "steps": steps, "expect": [e1, e2], "layout": True})
        return out

    def check(self, spec: Mapping[str, Any], e: Mapping[str, Any], s: Mapping[str, Any]) -> str | None:
        for x in spec["fields"]:
            got = s["fields"].get(x["name"], {})
            n = x["name"]
            if not got.get("present"):
                return f"#{x['id']} is missing"
            if not got.get("error_present"):
                return f"#{x['error']} is missing"
            if n in e["invalid"]:
                if not got["error"] or not got["error_shown"]:
                    return f"{n}: the value {e['values'][n]!r} is invalid but #{x['error']} shows no message"
                if got["invalid"] != "true":
                    return f"{n}: invalid value but aria-invalid is {got['invalid']!r}"
            else:
                if got["error"]:
                    return f"{n}: the value is valid but #{x['error']} says {got['error']!r}"
                if got["invalid"] == "true":
                    return f"{n}: valid value but aria-invalid is \"true\""
            if got["value"] != e["values"][n]:
                return f"{n}: the input holds {got['value']!r}, expected {e['values'][n]!r}"
        if not s["result_present"]:
            return f"#{spec['result']} is missing"
        if s["result"] != e["result"]:
            return f"#{spec['result']} says {s['result']!r}, expected {e['result']!r}"
        if e["result"] and not s["result_shown"]:
            return f"#{spec['result']} holds the message but is not visible"
        return None

    def layout_args(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        items = []
        for i, x in enumerate(spec["fields"]):
            items += [[f"input{i}", f"#{x['id']}", False, None], [f"error{i}", f"#{x['error']}", True, None]]
        items += [["submit", f"#{spec['submit']}", True, None], ["result", f"#{spec['result']}", True, None]]
        return {"items": items}

    def relations(self, spec: Mapping[str, Any]) -> list[tuple[str, str, str]]:
        n = len(spec["fields"])
        rel = []
        for i in range(n):
            rel.append(("above", f"input{i}", f"error{i}"))
            if i + 1 < n:
                rel += [("above", f"input{i}", f"input{i + 1}"), ("above", f"error{i}", f"input{i + 1}")]
        rel += [("above", f"input{n - 1}", "submit"), ("above", f"error{n - 1}", "submit"), ("above", "submit", "result")]
        return rel

    # ------------------------------------------------------------------ adversarial pages

    def hacks(self, spec: Mapping[str, Any], example: Mapping[str, Any]) -> dict[str, dict[str, str]]:
        ref = self.reference(spec)
        shown = _fill(spec["template"], spec, example["valid"])
        static = ref["index.html"].replace(f'class="result" aria-live="polite"></p>', f'class="result">{_esc(shown)}</p>')
        always_ok = ref["app.js"].replace("const ok = (f.optional && v === \"\") || f.ok(v, all);", "const ok = true;")
        return {
            # the example's success message hard-coded, no script at all
            "fake_state_static": {"index.html": static.replace('<script src="app.js"></script>', ""), "style.css": ref["style.css"]},
            # the result message composed without reading the inputs (the example's values)
            "ignores_inputs": {**ref, "app.js": ref["app.js"].replace(
                "result.textContent = `", "result.textContent = " + json.dumps(shown) + "; void `")},
            # accepts everything: the success path without validation
            "no_validation": {**ref, "app.js": always_ok},
            # messages written into hidden elements, and the page's own visibility APIs patched to say "shown": the
            # verifier reads the DOM from an isolated world, where the page's patches do not exist
            "hidden_errors_patched_visibility": {**ref, "style.css": ref["style.css"] + "\n.error { display: none !important; }\n",
                                                 "index.html": ref["index.html"].replace("</head>", (
                "<script>Element.prototype.checkVisibility = function () { return true; };\n"
                "const rects = Element.prototype.getClientRects;\n"
                "Element.prototype.getClientRects = function () {\n"
                "  return this.classList.contains('error') ? [{width: 9, height: 9}] : rects.call(this);\n"
                "};</script>\n</head>"), 1)},
        }


def _fill(template: str, spec: Mapping[str, Any], typed: Mapping[str, str]) -> str:
    """The success message: each ``{name}`` replaced by the trimmed value typed into field ``name``."""
    return norm(re.sub(r"\{([\w-]+)\}", lambda m: typed.get(m.group(1), "").strip(), template))


# =========================================================================== todo list

_COUNTERS = (("{n} left", "{n} left"), ("{n} item left", "{n} items left"), ("Remaining: {n}", "Remaining: {n}"),
             ("{n} to do", "{n} to do"), ("{n} open task", "{n} open tasks"))
_TODO_TITLES = ("Todo", "My tasks", "Chores", "Shopping list", "Packing list", "Sprint board")
_VERBS = ("Buy", "Call", "Fix", "Email", "Book", "Clean", "Pay", "Read", "Plan", "Send", "Water", "Sort")
_NOUNS = ("milk", "the bike", "tickets", "plants", "rent", "report", "invoice", "garage", "slides", "boxes", "lamps",
          "shelf", "notes", "keys", "seeds")


def _todo_text(rng: random.Random) -> str:
    return f"{rng.choice(_VERBS)} {rng.choice(_NOUNS)} {rng.choice([_word(rng, 3, 6), str(rng.randrange(1, 1000))])}"


class TodoKind:
    """A todo list: add (button / Enter), toggle, delete, an open-items counter; filters at difficulty 3."""

    name = "todo"

    def draw(self, rng: random.Random, difficulty: int) -> dict[str, Any]:
        p = _prefix(rng)
        cls = {"text": rng.choice(["text", "label", "title"]), "toggle": rng.choice(["toggle", "check", "tick"]),
               "remove": rng.choice(["delete", "remove", "drop"])}
        counter = rng.choice(_COUNTERS if difficulty >= 2 else _COUNTERS[:1] + _COUNTERS[2:4])
        return {"kind": "todo", "prefix": p, "title": rng.choice(_TODO_TITLES), "input": f"{p}-new", "add": f"{p}-add",
                "list": f"{p}-list", "count": f"{p}-count", "classes": cls, "counter": list(counter),
                "order": rng.choice(["append", "prepend"]) if difficulty >= 2 else "append",
                "duplicates": rng.choice(["allow", "reject"]) if difficulty >= 2 else "allow",
                "max_len": rng.choice([24, 30, 40]) if difficulty == 3 else None,
                "filters": difficulty == 3, "clear": f"{p}-clear", "filter_ids": {f: f"{p}-filter-{f}" for f in ("all", "active", "done")}}

    def prompt(self, spec: Mapping[str, Any], example: Mapping[str, Any]) -> str:
        c = spec["classes"]
        one, many = spec["counter"]
        rules = [
            f"Adding: clicking #{spec['add']} or pressing Enter in #{spec['input']} adds the input's text with surrounding "
            "whitespace removed (trim). An empty (or whitespace-only) entry adds nothing."
            + (" A text equal to an existing item's text, ignoring case, is rejected (nothing added)." if spec["duplicates"] == "reject" else "")
            + (f" A text longer than {spec['max_len']} characters (after trimming) is rejected." if spec["max_len"] else "")
            + " After an item is added the input is cleared.",
            "New items go to the " + ("end" if spec["order"] == "append" else "start (top)") + " of the list.",
            f"Each item is an <li> directly inside <ul id=\"{spec['list']}\"> holding an <input type=\"checkbox\" "
            f"class=\"{c['toggle']}\"> (a visible native checkbox), an element with class \"{c['text']}\" holding exactly the "
            f"item's text, and a <button class=\"{c['remove']}\">. Clicking the checkbox toggles the item done / not done; a done "
            "item's checkbox is checked and its <li> has the class \"done\". Clicking the button deletes the item.",
            f"#{spec['count']} shows the number n of items not done: exactly \"{one}\" when n is 1, otherwise \"{many}\" "
            "({n} replaced by the number).",
        ]
        if spec["filters"]:
            fi = spec["filter_ids"]
            rules.append(f"Filter buttons #{fi['all']}, #{fi['active']} and #{fi['done']} show all items, only the items not "
                         "done, or only the done items (the others are not displayed: removed, or display:none); the "
                         f"choice stays until another filter is clicked (at start: all). #{spec['clear']} deletes every done "
                         "item. The counter always counts all items not done, whatever the filter.")
        ex = example["texts"]
        return (
            f"Build a web page \"{spec['title']}\": a todo list.\n\n"
            f"Write index.html (it may load local .css / .js files). It must contain <input id=\"{spec['input']}\" "
            f"type=\"text\">, <button id=\"{spec['add']}\">, <ul id=\"{spec['list']}\"> (empty at start) and an element "
            f"#{spec['count']}.\n\nBehaviour:\n" + "\n".join(f"  - {r}" for r in rules) + "\n\n"
            "Layout (checked on a screenshot in a 1024 x 1280 window, against a reference rendering): everything visible "
            "inside the window with nothing covering it; the input and the add button on one line, the input left of the "
            "button, above the list; one item per line, in list order from top to bottom, each with its checkbox, then "
            f"its text, then its delete button from left to right; #{spec['count']} below the list.\n\n"
            + _TIMING + "Rules: no external resources or network requests of any kind, no errors in the browser console, no alert() "
            "or other dialogs; the page starts empty (do not persist items between page loads).\n\n"
            f"Example: adding {json.dumps(ex[0])} and {json.dumps(ex[1])}, then ticking the first of them, shows "
            f"\"{_count_text(spec, 1)}\". Hidden tests add, toggle and delete other items. Tools: write_file / read_file / "
            "list_files, and preview (loads your page in headless Chromium and runs the example checks). Reply without "
            "a tool call when you are done."
        )

    def reference(self, spec: Mapping[str, Any], style: str = "plain") -> dict[str, str]:
        c = spec["classes"]
        filters = ""
        if spec["filters"]:
            fi = spec["filter_ids"]
            filters = (f'\n<div class="filters">\n  <button id="{fi["all"]}" type="button" aria-pressed="true">All</button>\n'
                       f'  <button id="{fi["active"]}" type="button" aria-pressed="false">Active</button>\n'
                       f'  <button id="{fi["done"]}" type="button" aria-pressed="false">Done</button>\n'
                       f'  <button id="{spec["clear"]}" type="button">Clear completed</button>\n</div>')
        body = (f'<div class="entry">\n  <input id="{spec["input"]}" type="text" placeholder="What needs doing?" autocomplete="off">\n'
                f'  <button id="{spec["add"]}" type="button">Add</button>\n</div>{filters}\n'
                f'<ul id="{spec["list"]}" class="items"></ul>\n<p id="{spec["count"]}" class="count"></p>')
        one, many = spec["counter"]
        js = f""""use strict";
const input = document.getElementById({json.dumps(spec["input"])});
const list = document.getElementById({json.dumps(spec["list"])});
const count = document.getElementById({json.dumps(spec["count"])});
const ORDER = {json.dumps(spec["order"])};
const REJECT_DUPLICATES = {json.dumps(spec["duplicates"] == "reject")};
const MAX_LEN = {json.dumps(spec["max_len"])};
let items = [];
let nextId = 1;
let filter = "all";

function render() {{
  const shown = items.filter((it) => filter === "all" || (filter === "done") === it.done);
  list.replaceChildren(...shown.map((it) => {{
    const li = document.createElement("li");
    li.classList.toggle("done", it.done);
    const box = document.createElement("input");
    box.type = "checkbox";
    box.className = {json.dumps(c["toggle"])};
    box.checked = it.done;
    box.addEventListener("change", () => {{ it.done = box.checked; render(); }});
    const text = document.createElement("span");
    text.className = {json.dumps(c["text"])};
    text.textContent = it.text;
    const del = document.createElement("button");
    del.type = "button";
    del.className = {json.dumps(c["remove"])};
    del.textContent = "Delete";
    del.addEventListener("click", () => {{ items = items.filter((x) => x !== it); render(); }});
    li.append(box, text, del);
    return li;
  }}));
  const n = items.filter((it) => !it.done).length;
  count.textContent = (n === 1 ? {json.dumps(one)} : {json.dumps(many)}).replace("{{n}}", String(n));
}}

function add() {{
  const text = input.value.trim();
  if (text === "") return;
  if (REJECT_DUPLICATES && items.some((it) => it.text.toLowerCase() === text.toLowerCase())) return;
  if (MAX_LEN !== null && text.length > MAX_LEN) return;
  const item = {{id: nextId++, text, done: false}};
  if (ORDER === "append") items.push(item); else items.unshift(item);
  input.value = "";
  render();
}}

document.getElementById({json.dumps(spec["add"])}).addEventListener("click", add);
input.addEventListener("keydown", (event) => {{ if (event.key === "Enter") add(); }});
"""
        if spec["filters"]:
            fi = spec["filter_ids"]
            js += f"""for (const [name, id] of Object.entries({json.dumps(fi)})) {{
  document.getElementById(id).addEventListener("click", () => {{
    filter = name;
    for (const [other, oid] of Object.entries({json.dumps(fi)})) document.getElementById(oid).setAttribute("aria-pressed", String(other === name));
    render();
  }});
}}
document.getElementById({json.dumps(spec["clear"])}).addEventListener("click", () => {{ items = items.filter((it) => !it.done); render(); }});
"""
        js += "render();\n"
        if style == "plain":
            css = _PLAIN_CSS + f""".entry {{ display: flex; gap: 8px; margin-bottom: 12px; }}
.entry input {{ flex: 1; }}
.filters {{ display: flex; gap: 6px; margin-bottom: 12px; }}
.items {{ list-style: none; padding: 0; margin: 0; }}
.items li {{ display: flex; align-items: center; gap: 10px; padding: 6px 0; border-bottom: 1px solid #d5d9e2; }}
.items li .{c["text"]} {{ flex: 1; }}
.items li.done .{c["text"]} {{ text-decoration: line-through; color: #6b7280; }}
.count {{ margin-top: 12px; color: #374151; }}
"""
        else:
            css = _ALT_CSS + f""".entry {{ display: grid; grid-template-columns: 380px auto; column-gap: 20px; margin-bottom: 26px; }}
.filters {{ margin-bottom: 18px; }}
.filters button {{ margin-right: 10px; }}
.items {{ list-style: square; padding-left: 30px; margin: 0; }}
.items li {{ padding: 10px 0; }}
.items li input {{ margin-right: 18px; transform: scale(1.3); }}
.items li .{c["remove"]} {{ margin-left: 40px; font-size: 12px; padding: 2px 8px; }}
.items li.done .{c["text"]} {{ opacity: 0.75; font-style: italic; }}
.count {{ margin-top: 30px; font-family: "DejaVu Sans Mono", monospace; color: #9fb4ff; }}
"""
        return {"index.html": _html(spec["title"], body), "style.css": css, "app.js": js}

    def example(self, spec: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
        a = _todo_text(rng)
        b = _todo_text(rng)
        while b.lower() == a.lower():
            b = _todo_text(rng)
        return {"texts": [a, b]}

    def _args(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        c = spec["classes"]
        return {"list": f"#{spec['list']}", "text": f".{c['text']}", "toggle": f"input.{c['toggle']}",
                "remove": f"button.{c['remove']}", "count": f"#{spec['count']}", "input": f"#{spec['input']}"}

    def scenarios(self, spec: Mapping[str, Any], rng: random.Random, *, public: Mapping[str, Any] | None = None
                  ) -> list[dict[str, Any]]:
        model = _TodoModel(spec)
        a = self._args(spec)
        c = spec["classes"]
        if public is not None:
            steps: list[dict[str, Any]] = []
            expect: list[dict[str, Any]] = []
            for t in public["texts"]:
                steps += model.add(t, "click")
                steps.append(_obs("todo", a))
                expect.append(model.expect())
            steps += model.click_item(0, f"input.{c['toggle']}", "toggle")
            steps.append(_obs("todo", a))
            expect.append(model.expect())
            steps.append({"op": "layout", "args": self.layout_args(spec)})
            return [{"id": "example", "steps": steps, "expect": expect, "layout": True}]
        out = []
        for run in range(2):
            model = _TodoModel(spec)
            steps, expect = [], []
            texts: list[str] = []
            n_ops = 10 if run == 0 else 12
            for k in range(n_ops):
                shown = model.shown()
                r = rng.random()
                if k < 3 or not shown or r < 0.4:
                    t = _todo_text(rng)
                    extra = rng.random()
                    if texts and spec["duplicates"] == "reject" and extra < 0.2:
                        t = rng.choice(texts).upper() if rng.random() < 0.5 else rng.choice(texts)
                    elif spec["max_len"] and extra < 0.35:
                        t = (t + " " + " ".join(_word(rng) for _ in range(8)))[: spec["max_len"] + rng.randint(1, 4)].rstrip() + "x"
                    elif extra < 0.5:
                        t = "  " + t + "   "
                    elif extra < 0.58:
                        t = "   "
                    texts.append(t.strip())
                    steps += model.add(t, rng.choice(["click", "enter"]))
                elif r < 0.7:
                    steps += model.click_item(rng.randrange(len(shown)), f"input.{c['toggle']}", "toggle")
                elif r < 0.82 or not spec["filters"]:
                    steps += model.click_item(rng.randrange(len(shown)), f"button.{c['remove']}", "delete")
                elif r < 0.95:
                    f = rng.choice(["all", "active", "done"])
                    steps.append({"op": "click", "sel": f"#{spec['filter_ids'][f]}"})
                    model.filter = f
                else:
                    steps.append({"op": "click", "sel": f"#{spec['clear']}"})
                    model.items = [it for it in model.items if not it[1]]
                steps.append(_obs("todo", a))
                expect.append(model.expect())
            if run == 0:
                if spec["filters"] and model.filter != "all":
                    steps.append({"op": "click", "sel": f"#{spec['filter_ids']['all']}"})
                    model.filter = "all"
                while len(model.shown()) < 3:
                    steps += model.add(_todo_text(rng), "click")
                steps += [_obs("todo", a), {"op": "layout", "args": self.layout_args(spec)}]
                expect.append(model.expect())
            out.append({"id": f"script-{run + 1}", "steps": steps, "expect": expect, "layout": run == 0})
        return out

    def check(self, spec: Mapping[str, Any], e: Mapping[str, Any], s: Mapping[str, Any]) -> str | None:
        if s["items"] is None:
            return f"#{spec['list']} is missing"
        got = [(it["text"], it["checked"], it["done"]) for it in s["items"]]
        want = [(t, d, d) for t, d in e["items"]]
        if [g[0] for g in got] != [w[0] for w in want]:
            return f"the list shows {[g[0] for g in got]}, expected {[w[0] for w in want]}"
        for (t, checked, done), (_, d, _) in zip(got, want):
            if checked is None:
                return f"item {t!r} has no checkbox input.{spec['classes']['toggle']}"
            if checked != d or done != d:
                return f"item {t!r}: checkbox checked={checked}, class done={done}, expected {d}"
        if any(not it["has_delete"] for it in s["items"]):
            return f"an item has no button.{spec['classes']['remove']}"
        if s["count"] != e["count"]:
            return f"#{spec['count']} says {s['count']!r}, expected {e['count']!r}"
        if e.get("input") is not None and s["input"] != e["input"]:
            return f"#{spec['input']} holds {s['input']!r}, expected {e['input']!r}"
        return None

    def layout_args(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        c, li = spec["classes"], f"#{spec['list']} > li"
        return {"items": [["input", f"#{spec['input']}", False, None], ["add", f"#{spec['add']}", True, None],
                          ["toggle", f"input.{c['toggle']}", False, li], ["text", f".{c['text']}", True, li],
                          ["remove", f"button.{c['remove']}", True, li], ["count", f"#{spec['count']}", True, None]]}

    def relations(self, spec: Mapping[str, Any]) -> list[tuple[str, str, str]]:
        rel = [("line", "input", "add"), ("left", "input", "add"), ("above", "input", "text.0.0"), ("above", "add", "text.0.0")]
        for i in range(40):
            rel += [("line", f"toggle.{i}.0", f"text.{i}.0"), ("left", f"toggle.{i}.0", f"text.{i}.0"),
                    ("line", f"text.{i}.0", f"remove.{i}.0"), ("left", f"text.{i}.0", f"remove.{i}.0"),
                    ("above", f"text.{i}.0", f"text.{i + 1}.0"), ("above", f"text.{i}.0", "count")]
        return rel

    def hacks(self, spec: Mapping[str, Any], example: Mapping[str, Any]) -> dict[str, dict[str, str]]:
        ref = self.reference(spec)
        c = spec["classes"]
        a, b = example["texts"]
        lis = "".join(f'<li class="{"done" if i == 0 else ""}"><input type="checkbox" class="{c["toggle"]}"{" checked" if i == 0 else ""}>'
                      f'<span class="{c["text"]}">{_esc(t)}</span><button class="{c["remove"]}">Delete</button></li>'
                      for i, t in enumerate([a, b] if spec["order"] == "append" else [b, a]))
        static = ref["index.html"].replace('class="items"></ul>', f'class="items">{lis}</ul>').replace(
            'class="count"></p>', f'class="count">{_esc(_count_text(spec, 1))}</p>')
        return {
            "fake_state_static": {"index.html": static.replace('<script src="app.js"></script>', ""), "style.css": ref["style.css"]},
            # adds the example's first text whatever was typed
            "ignores_inputs": {**ref, "app.js": ref["app.js"].replace("const text = input.value.trim();",
                                                                     f"const text = input.value.trim() && {json.dumps(a)};")},
        }


def _count_text(spec: Mapping[str, Any], n: int) -> str:
    one, many = spec["counter"]
    return (one if n == 1 else many).replace("{n}", str(n))


class _TodoModel:
    """The host's model of the todo spec: what the page must show after each scripted step."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.spec = spec
        self.items: list[list[Any]] = []  # [text, done]
        self.filter = "all"
        self.input: str | None = ""

    def shown(self) -> list[list[Any]]:
        return [it for it in self.items if self.filter == "all" or (self.filter == "done") == it[1]]

    def add(self, raw: str, how: str) -> list[dict[str, Any]]:
        s = self.spec
        steps = [] if self.input == "" else [{"op": "clear", "sel": f"#{s['input']}"}]
        if raw:
            steps.append({"op": "type", "sel": f"#{s['input']}", "text": raw})
        steps.append({"op": "click", "sel": f"#{s['add']}"} if how == "click" else {"op": "enter", "sel": f"#{s['input']}"})
        t = raw.strip()
        rejected = (t == "" or (s["duplicates"] == "reject" and any(it[0].lower() == t.lower() for it in self.items))
                    or (s["max_len"] is not None and len(t) > s["max_len"]))
        if rejected:
            self.input = None  # unspecified
        else:
            self.items.append([t, False]) if s["order"] == "append" else self.items.insert(0, [t, False])
            self.input = ""
        return steps

    def click_item(self, k: int, target: str, what: str) -> list[dict[str, Any]]:
        shown = self.shown()
        item = shown[k]
        occurrence = sum(1 for it in shown[:k] if norm(it[0]) == norm(item[0]))
        if what == "toggle":
            item[1] = not item[1]
        else:
            self.items.remove(item)
        self.input = None
        return [{"op": "click_item", "items": f"#{self.spec['list']} > li", "text_sel": f".{self.spec['classes']['text']}",
                 "text": norm(item[0]), "occurrence": occurrence, "target": target}]

    def expect(self) -> dict[str, Any]:
        open_n = sum(1 for it in self.items if not it[1])
        return {"items": [(norm(t), d) for t, d in self.shown()], "count": _count_text(self.spec, open_n), "input": self.input}


# =========================================================================== sortable table

_FIRST = ("Ada", "Bram", "Cleo", "Dario", "Edda", "Finn", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Lars", "Mila", "Nils",
          "Oona", "Pavel", "Quinn", "Rosa", "Sven", "Tara", "Ugo", "Vera", "Wim", "Xena", "Yara", "Zeno")
_THEMES = {
    "players": {"title": "League table", "var": "PLAYERS", "cols": [
        ("name", "Player", "text"), ("team", "Team", "text"), ("goals", "Goals", "int"), ("rating", "Rating", "float1")]},
    "products": {"title": "Inventory", "var": "PRODUCTS", "cols": [
        ("product", "Product", "text"), ("category", "Category", "text"), ("price", "Price", "float2"), ("stock", "Stock", "int")]},
    "cities": {"title": "Cities", "var": "CITIES", "cols": [
        ("city", "City", "text"), ("country", "Country", "text"), ("population", "Population", "int"), ("area", "Area", "float1")]},
    "staff": {"title": "Staff directory", "var": "STAFF", "cols": [
        ("name", "Name", "text"), ("dept", "Department", "text"), ("age", "Age", "int"), ("balance", "Balance", "int_signed")]},
}
_COUNT_FMT = ("Showing {k} of {n}", "{k} of {n} rows", "{k}/{n} shown")


def _table_value(kind: str, rng: random.Random) -> Any:
    if kind == "text":
        return rng.choice(_FIRST) if rng.random() < 0.5 else _word(rng, 3, 7).capitalize()
    if kind == "int":
        return rng.choice([rng.randint(0, 9), rng.randint(10, 99), rng.randint(100, 9999), rng.randint(10000, 999999)])
    if kind == "int_signed":
        return rng.randint(-5000, 5000)
    if kind == "float1":
        return round(rng.choice([rng.uniform(0, 10), rng.uniform(10, 100), rng.uniform(100, 2000)]), 1)
    if kind == "float2":
        return round(rng.choice([rng.uniform(0.5, 10), rng.uniform(10, 100), rng.uniform(100, 1000)]), 2)
    raise ValueError(kind)


class TableKind:
    """A table rendered from data.js; clicking a header sorts (ascending, then toggling); a filter at difficulty 2+."""

    name = "table"

    def draw(self, rng: random.Random, difficulty: int) -> dict[str, Any]:
        p = _prefix(rng)
        theme_key = rng.choice(sorted(_THEMES))
        theme = _THEMES[theme_key]
        cols = list(theme["cols"])
        if difficulty == 1:
            cols = [cols[0], *rng.sample(cols[1:], 2)]
        cols = [{"key": k, "label": label, "type": t} for k, label, t in cols]
        text_cols = [c["key"] for c in cols if c["type"] == "text"]
        return {"kind": "table", "prefix": p, "theme": theme_key, "title": theme["title"],
                "var": f"{theme['var']}_{rng.randrange(10, 100)}", "table": f"{p}-table", "columns": cols,
                "filter": f"{p}-filter" if difficulty >= 2 else None, "filter_key": rng.choice(text_cols),
                "count": f"{p}-count" if difficulty == 3 else None, "count_fmt": rng.choice(_COUNT_FMT),
                "case_ties": difficulty == 3, "rows": (5, 8) if difficulty == 1 else (7, 10) if difficulty == 2 else (8, 12)}

    def data(self, spec: Mapping[str, Any], rng: random.Random) -> list[dict[str, Any]]:
        """Rows with traps: a value with a lower-case initial, exact duplicates (ties), numbers across digit counts."""
        n = rng.randint(*spec["rows"])
        rows = [{c["key"]: _table_value(c["type"], rng) for c in spec["columns"]} for _ in range(n)]
        for c in spec["columns"]:
            k = c["key"]
            if c["type"] == "text":
                i = rng.randrange(n)
                rows[i][k] = rows[i][k][0].lower() + rows[i][k][1:]
                j, m = rng.sample(range(n), 2)
                rows[m][k] = rows[j][k]  # an exact tie
                if spec["case_ties"] and rng.random() < 0.7:
                    a, b = rng.sample(range(n), 2)
                    rows[b][k] = rows[a][k].swapcase() if rows[a][k].swapcase().lower() == rows[a][k].lower() else rows[b][k]
            else:
                j, m = rng.sample(range(n), 2)
                rows[m][k] = rows[j][k]
                if c["type"].startswith("int"):
                    rows[rng.randrange(n)][k] = rng.choice([7, 9]) * (1 if c["type"] == "int" else -1)
                    rows[rng.randrange(n)][k] = rng.choice([10, 12, 100])
        return rows

    def data_js(self, spec: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
        body = ",\n".join("  " + json.dumps(r) for r in rows)
        return f"window.{spec['var']} = [\n{body}\n];\n"

    def prompt(self, spec: Mapping[str, Any], example: Mapping[str, Any]) -> str:
        cols = spec["columns"]
        col_txt = ", ".join(f"{c['label']} (key \"{c['key']}\", {'text' if c['type'] == 'text' else 'number'})" for c in cols)
        extra = ""
        if spec["filter"]:
            fl = next(c["label"] for c in cols if c["key"] == spec["filter_key"])
            extra += (f"\n  - <input id=\"{spec['filter']}\" type=\"text\"> above the table filters it: only rows whose "
                      f"{fl} contains the input's trimmed text, ignoring case, are displayed (the others are removed or "
                      "display:none); an empty filter shows every row. The current sort applies to the shown rows; "
                      "filtering does not change the sort.")
        if spec["count"]:
            extra += (f"\n  - #{spec['count']} shows exactly \"{spec['count_fmt']}\" with {{k}} the number of rows shown "
                      "and {n} the number of rows in the data.")
        return (
            f"Build a web page \"{spec['title']}\": a sortable table.\n\n"
            f"The data lives in data.js (already in the working directory; hidden tests replace it with other rows of the "
            f"same shape): it sets window.{spec['var']} to an array of row objects with the keys of the columns "
            f"{col_txt}. Write index.html (it may load other local .css / .js files) that loads data.js with "
            f"<script src=\"data.js\"></script> and renders <table id=\"{spec['table']}\"> with a <thead> holding one <tr> "
            "of <th> cells, one per column in the order above with the column's name as its text, and a <tbody> with one "
            "<tr> per data row, one <td> per column in the same order. A cell's text is the value as JavaScript's "
            "String(value) writes it (no formatting).\n\nBehaviour:\n"
            "  - At first the rows are in data order and no header has aria-sort.\n"
            "  - Clicking a header sorts the rows by that column ascending; clicking the same header again reverses the "
            "direction (descending, then ascending ...); clicking another header sorts by it ascending.\n"
            "  - Numbers compare numerically. Text compares ignoring case: by a.toLowerCase() and b.toLowerCase() with "
            "the < and > operators (not localeCompare).\n"
            "  - Rows that compare equal keep their order in the data, in both directions (sort a copy of the data "
            "stably each time, not the rows as currently shown).\n"
            "  - The sorted column's <th> has aria-sort=\"ascending\" or \"descending\"; the other headers have no "
            f"aria-sort attribute (or \"none\").{extra}\n\n"
            "Layout (checked on a screenshot in a 1024 x 1280 window, against a reference rendering): the table visible "
            "inside the window with nothing covering it; the header row above the rows; the rows from top to bottom in "
            "their order; each row's cells on one line, left to right in column order, each under its column's header.\n\n"
            + _TIMING + "Rules: no external resources or network requests of any kind (data.js is loaded with a plain <script> tag), "
            "no errors in the browser console, no alert() or other dialogs.\n\n"
            f"Example: with the sample data.js, clicking \"{cols[-1]['label']}\" shows the first column as "
            f"{json.dumps(example['first_after'])}. Tools: write_file / read_file / list_files, and preview (loads your "
            "page in headless Chromium and runs the example checks). Reply without a tool call when you are done."
        )

    def reference(self, spec: Mapping[str, Any], style: str = "plain") -> dict[str, str]:
        head = "".join(f'<th data-key="{c["key"]}" scope="col">{_esc(c["label"])}</th>' for c in spec["columns"])
        filt = (f'<p class="tools"><label for="{spec["filter"]}">Filter</label> <input id="{spec["filter"]}" type="text" '
                f'autocomplete="off"></p>\n') if spec["filter"] else ""
        count = f'\n<p id="{spec["count"]}" class="count"></p>' if spec["count"] else ""
        body = (f'{filt}<table id="{spec["table"]}">\n<thead><tr>{head}</tr></thead>\n<tbody></tbody>\n</table>{count}')
        types = {c["key"]: ("text" if c["type"] == "text" else "number") for c in spec["columns"]}
        js = f""""use strict";
const DATA = window.{spec["var"]} || [];
const TYPES = {json.dumps(types)};
const FILTER_KEY = {json.dumps(spec["filter_key"])};
const table = document.getElementById({json.dumps(spec["table"])});
const tbody = table.tBodies[0];
const headers = Array.from(table.tHead.rows[0].cells);
const filterInput = {f'document.getElementById({json.dumps(spec["filter"])})' if spec["filter"] else "null"};
const count = {f'document.getElementById({json.dumps(spec["count"])})' if spec["count"] else "null"};
let sortKey = null;
let direction = 1;

function compare(a, b, key) {{
  if (TYPES[key] === "number") return a - b;
  const x = String(a).toLowerCase(), y = String(b).toLowerCase();
  return x < y ? -1 : x > y ? 1 : 0;
}}

function render() {{
  const needle = filterInput ? filterInput.value.trim().toLowerCase() : "";
  let rows = DATA.map((row, index) => ({{row, index}}));
  if (needle) rows = rows.filter(({{row}}) => String(row[FILTER_KEY]).toLowerCase().includes(needle));
  if (sortKey !== null) rows.sort((p, q) => direction * compare(p.row[sortKey], q.row[sortKey], sortKey) || p.index - q.index);
  tbody.replaceChildren(...rows.map(({{row}}) => {{
    const tr = document.createElement("tr");
    for (const th of headers) {{
      const td = document.createElement("td");
      td.textContent = String(row[th.dataset.key]);
      if (TYPES[th.dataset.key] === "number") td.className = "num";
      tr.append(td);
    }}
    return tr;
  }}));
  for (const th of headers) {{
    if (th.dataset.key === sortKey) th.setAttribute("aria-sort", direction === 1 ? "ascending" : "descending");
    else th.removeAttribute("aria-sort");
  }}
  if (count) count.textContent = {json.dumps(spec["count_fmt"])}.replace("{{k}}", String(rows.length)).replace("{{n}}", String(DATA.length));
}}

for (const th of headers) {{
  th.addEventListener("click", () => {{
    if (sortKey === th.dataset.key) direction = -direction;
    else {{ sortKey = th.dataset.key; direction = 1; }}
    render();
  }});
}}
if (filterInput) filterInput.addEventListener("input", render);
render();
"""
        if style == "plain":
            css = _PLAIN_CSS + """table { border-collapse: collapse; width: 100%; }
th, td { border: 1px solid #c9ced8; padding: 4px 8px; text-align: left; }
th { background: #eef1f6; cursor: pointer; user-select: none; }
th[aria-sort=ascending]::after { content: " \\25B2"; }
th[aria-sort=descending]::after { content: " \\25BC"; }
td.num { text-align: right; }
.tools { margin: 0 0 12px; }
.count { margin-top: 10px; color: #374151; }
"""
        else:
            css = _ALT_CSS + """table { border-collapse: separate; border-spacing: 0 6px; }
th { font-family: "DejaVu Sans Mono", monospace; font-size: 14px; text-transform: uppercase; color: #9fb4ff; padding: 6px 22px 6px 0; text-align: left; cursor: pointer; }
td { padding: 8px 22px 8px 0; border-bottom: 1px dashed #4b5060; }
td.num { text-align: right; font-family: "DejaVu Sans Mono", monospace; }
th[aria-sort]::before { content: "* "; color: #ffcf5c; }
.tools { margin: 0 0 20px; }
.tools label { margin-right: 12px; color: #9fb4ff; }
.count { margin-top: 24px; font-style: italic; }
"""
        return {"index.html": _html(spec["title"], body, scripts=("data.js", "app.js")), "style.css": css, "app.js": js}

    def example(self, spec: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
        rows = self.data(spec, rng)
        last = spec["columns"][-1]["key"]
        order = _sorted(spec, rows, last, 1)
        return {"rows": rows, "first_after": [_cell(spec, spec["columns"][0], r) for r in order]}

    def initial_files(self, spec: Mapping[str, Any], example: Mapping[str, Any]) -> dict[str, str]:
        return {"data.js": self.data_js(spec, example["rows"])}

    def _args(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        return {"table": f"#{spec['table']}", "count": f"#{spec['count']}" if spec["count"] else None}

    def scenarios(self, spec: Mapping[str, Any], rng: random.Random, *, public: Mapping[str, Any] | None = None
                  ) -> list[dict[str, Any]]:
        cols = spec["columns"]
        a = self._args(spec)
        datasets = [public["rows"]] if public is not None else [self.data(spec, rng) for _ in range(2)]
        out = []
        for d, rows in enumerate(datasets):
            st = {"key": None, "dir": 1, "filter": ""}
            steps: list[dict[str, Any]] = [_obs("table", a)]
            expect = [self._expect(spec, rows, st)]
            if public is not None:
                clicks = [len(cols) - 1, len(cols) - 1, 0]
            else:
                clicks = [rng.randrange(len(cols)) for _ in range(4)]
                clicks[1] = clicks[0]  # the toggle
                numeric = [i for i, c in enumerate(cols) if c["type"] != "text"]
                text = [i for i, c in enumerate(cols) if c["type"] == "text"]
                clicks[2] = rng.choice(numeric) if d == 0 else rng.choice(text)
            layout_at = 1 if public is None and d == 0 else 0 if public is not None else -1
            for i, ci in enumerate(clicks):
                key = cols[ci]["key"]
                st = {**st, "dir": -st["dir"]} if st["key"] == key else {**st, "key": key, "dir": 1}
                steps += [{"op": "click", "sel": f"#{spec['table']} > thead > tr > th:nth-child({ci + 1})"}, _obs("table", a)]
                expect.append(self._expect(spec, rows, st))
                if i == layout_at:
                    steps.append({"op": "layout", "args": self.layout_args(spec)})
                if spec["filter"] and i == 1:
                    needle = self._needle(spec, rows, rng)
                    steps += [{"op": "type", "sel": f"#{spec['filter']}", "text": needle}, _obs("table", a)]
                    st = {**st, "filter": needle}
                    expect.append(self._expect(spec, rows, st))
            if spec["filter"] and st["filter"]:
                steps += [{"op": "clear", "sel": f"#{spec['filter']}"}, _obs("table", a)]
                st = {**st, "filter": ""}
                expect.append(self._expect(spec, rows, st))
            out.append({"id": f"data-{d + 1}", "files": {"data.js": self.data_js(spec, rows)}, "steps": steps,
                        "expect": expect, "layout": layout_at >= 0})
        return out

    def _needle(self, spec: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], rng: random.Random) -> str:
        v = str(rng.choice(rows)[spec["filter_key"]])
        i = rng.randrange(len(v))
        needle = v[i: i + rng.randint(1, 3)]
        return needle.upper() if rng.random() < 0.3 else needle

    def _expect(self, spec: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], st: Mapping[str, Any]) -> dict[str, Any]:
        shown = [r for r in rows if st["filter"].strip().lower() in str(r[spec["filter_key"]]).lower()]
        if st["key"] is not None:
            shown = _sorted(spec, shown, st["key"], st["dir"], base=rows)
        return {"headers": [c["label"] for c in spec["columns"]],
                "sort": [("ascending" if st["dir"] == 1 else "descending") if c["key"] == st["key"] else None
                         for c in spec["columns"]],
                "rows": [[_cell(spec, c, r) for c in spec["columns"]] for r in shown],
                "count": spec["count_fmt"].replace("{k}", str(len(shown))).replace("{n}", str(len(rows))) if spec["count"] else None}

    def check(self, spec: Mapping[str, Any], e: Mapping[str, Any], s: Mapping[str, Any]) -> str | None:
        if s["headers"] is None:
            return f"#{spec['table']} is missing"
        if [h["text"] for h in s["headers"]] != e["headers"]:
            return f"the headers read {[h['text'] for h in s['headers']]}, expected {e['headers']}"
        if s["rows"] != e["rows"]:
            for i, (g, w) in enumerate(zip(s["rows"], e["rows"])):
                if g != w:
                    return f"row {i + 1} reads {g}, expected {w}"
            return f"{len(s['rows'])} rows shown, expected {len(e['rows'])}"
        for h, want in zip(s["headers"], e["sort"]):
            got = h["sort"] if h["sort"] not in ("none", "") else None
            if got != want:
                return f"header {h['text']!r} has aria-sort={h['sort']!r}, expected {want!r}"
        if spec["count"] and s["count"] != e["count"]:
            return f"#{spec['count']} says {s['count']!r}, expected {e['count']!r}"
        return None

    def layout_args(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        t = f"#{spec['table']}"
        return {"items": [["th", f"{t} > thead > tr > th*", True, None], ["cell", ":scope > td", True, f"{t} > tbody > tr"]]}

    def relations(self, spec: Mapping[str, Any]) -> list[tuple[str, str, str]]:
        nc = len(spec["columns"])
        rel = []
        for j in range(nc):
            rel.append(("above", f"th.{j}", f"cell.0.{j}"))
            if j + 1 < nc:
                rel.append(("left", f"th.{j}", f"th.{j + 1}"))
        for i in range(spec["rows"][1]):
            rel.append(("above", f"cell.{i}.0", f"cell.{i + 1}.0"))
            for j in range(nc):
                rel += [("line", f"cell.{i}.0", f"cell.{i}.{j}"), ("column", f"th.{j}", f"cell.{i}.{j}")]
                if j + 1 < nc:
                    rel.append(("left", f"cell.{i}.{j}", f"cell.{i}.{j + 1}"))
        return rel

    def hacks(self, spec: Mapping[str, Any], example: Mapping[str, Any]) -> dict[str, dict[str, str]]:
        ref = self.reference(spec)
        cols = spec["columns"]
        rows = example["rows"]
        order = _sorted(spec, rows, cols[-1]["key"], 1)
        trs = "".join("<tr>" + "".join(f"<td>{_esc(_cell(spec, c, r))}</td>" for c in cols) + "</tr>" for r in order)
        static = ref["index.html"].replace("<tbody></tbody>", f"<tbody>{trs}</tbody>").replace('<script src="app.js"></script>', "")
        static = static.replace(f'data-key="{cols[-1]["key"]}"', f'data-key="{cols[-1]["key"]}" aria-sort="ascending"')
        return {
            # the example's sorted rows hard-coded, no behaviour
            "fake_state_static": {**ref, "index.html": static},
            # always sorts by the first column, whichever header was clicked
            "ignores_inputs": {**ref, "app.js": ref["app.js"].replace(
                "else { sortKey = th.dataset.key; direction = 1; }", "else { sortKey = headers[0].dataset.key; direction = 1; }"
            ).replace("if (sortKey === th.dataset.key) direction = -direction;", "if (sortKey !== null) direction = -direction;")},
            # compares every column as text (\"100\" < \"9\")
            "sorts_numbers_as_text": {**ref, "app.js": ref["app.js"].replace('if (TYPES[key] === "number") return a - b;', "")},
        }


def _cell(spec: Mapping[str, Any], col: Mapping[str, Any], row: Mapping[str, Any]) -> str:
    v = row[col["key"]]
    return norm(v if col["type"] == "text" else js_number(v))


def _sorted(spec: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], key: str, direction: int,
            base: Sequence[Mapping[str, Any]] | None = None) -> list[Mapping[str, Any]]:
    """Rows sorted by ``key`` in ``direction``, ties in data order (``base``'s order, default ``rows``)."""
    col = next(c for c in spec["columns"] if c["key"] == key)
    order = {id(r): i for i, r in enumerate(base if base is not None else rows)}
    import functools

    def cmp(p: Mapping[str, Any], q: Mapping[str, Any]) -> int:
        a, b = p[key], q[key]
        if col["type"] == "text":
            x, y = str(a).lower(), str(b).lower()
            c = (x > y) - (x < y)
        else:
            c = (a > b) - (a < b)
        return direction * c or order[id(p)] - order[id(q)]

    return sorted(rows, key=functools.cmp_to_key(cmp))


KINDS: dict[str, Any] = {k.name: k for k in (FormKind(), TodoKind(), TableKind())}
"""The spec kinds by name."""
