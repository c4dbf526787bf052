"""Every command the README and docs/ show runs as written (issue 34).

Each fenced ``bash`` block of README.md and docs/*.md is listed in ``BLOCKS`` with how this suite runs it. A
block that is not listed, or a listed one the docs no longer have, fails `test_every_shell_block_is_listed`, so a
doc cannot change its commands without this file changing too. A block runs in a fresh temporary folder (with
``configs/`` linked in, as in a clone of the repository), one command at a time through bash, exactly as written
except for what its entry lists:

- ``subs``: literal replacements, each of which must occur (placeholder paths such as ``/models/``);
- ``sizes``: dotted overrides appended to every stage command (demo, pretrain, sft, rl, experts, mopd, draft) so
  that each stage runs a step or two instead of minutes (`tests/toy_sizes.py`); the rest of the command is as
  the doc has it, and a later override wins, so the doc's own settings other than sizes are what runs.

`k3post serve` in the foreground (as in a user's terminal) is started, waited for on /health, asked for one chat
completion, and stopped with Ctrl-C (SIGINT); servers the doc starts with ``&`` are stopped when the block ends.
Each command's exit status is checked (0 unless the entry says the doc expects an error) and its wall time is
printed (``-s``) and appended as a JSON line to ``$K3POST_DOCS_TIMES`` when that is set. With
``K3POST_DOCS_AS_WRITTEN=1`` no sizes are appended: every command runs exactly as the doc has it, at the doc's
sizes (the times in docs/post-train-your-own-model.md were measured so).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from toy_sizes import TOY_DEMO, TOY_SFT, TOY_STAGES
from user_models import save_user_model

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
SHELL = ("bash", "sh", "shell", "console")
STAGES = ("demo", "pretrain", "sft", "rl", "experts", "mopd", "draft")


@dataclass(frozen=True)
class Block:
    """A fenced code block of a doc: its file, the line of its opening fence, language and text."""

    file: str
    line: int
    lang: str
    text: str

    @property
    def key(self) -> tuple[str, str]:
        """(file, its first command without a trailing comment, spaces collapsed): how BLOCKS names it."""
        first = commands(self.text)[0] if commands(self.text) else ""
        return self.file, " ".join(re.sub(r"\s#.*$", "", first).split())


def blocks(file: str, langs: tuple[str, ...] = SHELL) -> list[Block]:
    text = (ROOT / file).read_text()
    out = []
    for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.S | re.M):
        if m.group(1) in langs:
            out.append(Block(file, text[:m.start()].count("\n") + 1, m.group(1), m.group(2)))
    return out


def commands(text: str) -> list[str]:
    """The block's commands: backslash continuations joined, blank lines and whole-line comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        s = line.rstrip()
        if not cur and (not s.strip() or s.lstrip().startswith("#")):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        out.append(cur + s)
        cur = ""
    assert not cur, f"a continuation line ends the block: {cur!r}"
    return out


@dataclass(frozen=True)
class Run:
    """How a block runs: ``fast`` (the default test run) or ``slow``; see the module docstring."""

    speed: str
    subs: tuple[tuple[str, str], ...] = ()
    sizes: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()  # runs/demo/sft/final ("demo_sft": what `k3post demo` leaves) or runs/full/sft/final
    # ("full_sft": the full recipe's) is there
    expect: tuple[tuple[str, int], ...] = ()  # (a command's text, its exit code) where the doc says it fails


@dataclass(frozen=True)
class NotRun:
    why: str


# The docs' path for a model of the user's own (docs/post-train-your-own-model.md): its commands run in
# order in one folder (test_post_train_your_own_model).
_OWN = "docs/post-train-your-own-model.md"
_OWN_SIZES = (*TOY_SFT, *TOY_STAGES)  # the model folder brings its tokenizer

BLOCKS: dict[tuple[str, str], Run | NotRun] = {
    ("README.md", "bash scripts/install.sh && k3post demo"): Run(
        "slow", subs=(("bash scripts/install.sh && ", ""),), sizes=TOY_DEMO),  # install.sh: test_ci_runs_...
    ("README.md", "k3post demo configs/demo.yaml sft.steps=300 run.name=short"): Run("slow", sizes=TOY_DEMO),
    ("README.md", "k3post demo configs/full.yaml"): Run("slow", sizes=TOY_DEMO),
    ("README.md", "python3 -m pytest"): NotRun("this suite itself; test_ci_runs_the_readme_commands checks that "
                                               ".ci/run runs exactly it"),
    ("README.md", "k3post rl configs/demo.yaml run.name=rl1 rl.init=runs/demo/sft/final rl.domain=general "
                  "rl.effort=max rl.steps=100"): Run("slow", sizes=TOY_DEMO, needs=("demo_sft",)),
    ("README.md", "k3post serve runs/demo/sft/final --port 30001 & k3post serve runs/demo/sft/final --port 30002 &"):
        Run("slow", sizes=TOY_DEMO, needs=("demo_sft",)),
    ("README.md", "k3post demo run.name=demo_http rl.rollout.engine.kind=http rl.rollout.engine.launch=1 mopd.rl.rollout.engine.kind=http "
                  "mopd.rl.rollout.engine.launch=1"): Run("slow", sizes=TOY_DEMO),
    (_OWN, "k3post add-tokens /models/my-llama /models/my-llama-xtml"): Run("fast", subs=(("/models/", "models/"),)),
    (_OWN, "k3post sft my-model.yaml"): Run("slow", sizes=_OWN_SIZES),
    ("docs/extending.md", "K3POST_FAMILIES=reverse_words PYTHONPATH=docs/examples k3post tasks check "
                          "general.reverse_words --n 8"):
        Run("fast", subs=(("PYTHONPATH=docs/examples", f"PYTHONPATH={ROOT / 'docs' / 'examples'}"),)),
    ("docs/scale-out.md", "torchrun --nnodes 4 --nproc-per-node 8 --node-rank $NODE_RANK --rdzv-backend c10d "
                          "--rdzv-endpoint HEAD:29500 -m k3post rl configs/qwen3-30b-a3b-64gpu.yaml "
                          "rl.init=/ckpt/sft/final"):
        NotRun("4 nodes of 8 GPUs; its config loads in tests/test_fsdp_stages.py"),
    ("docs/scale-out.md", "k3post rl configs/demo.yaml rl.init=runs/demo/sft/final distributed.enabled=true "
                          "distributed.num_cpus=2 distributed.fsdp.ranks=2 distributed.roles.trainers=2 "
                          "distributed.roles.engines=1 distributed.roles.env_workers=1 distributed.cpus_per_bundle=0.5"):
        Run("slow", sizes=TOY_DEMO, needs=("demo_sft", "full_sft")),
}


def all_blocks() -> list[Block]:
    return [b for f in DOCS for b in blocks(f)]


def _block(key: tuple[str, str]) -> Block:
    (b,) = [b for b in all_blocks() if b.key == key]
    return b


def test_every_shell_block_is_listed():
    found = {b.key: b for b in all_blocks()}
    unlisted = [f"{b.file}:{b.line}: {b.key[1]!r}" for k, b in found.items() if k not in BLOCKS]
    assert not unlisted, "shell blocks this suite does not run (add each to BLOCKS):\n" + "\n".join(unlisted)
    gone = [f"{f}: {c!r}" for f, c in BLOCKS if (f, c) not in found]
    assert not gone, "BLOCKS lists commands the docs no longer show:\n" + "\n".join(gone)
    assert len(found) == len(all_blocks()), "two blocks of one doc start with the same command"


def test_ci_runs_the_readme_commands():
    """.ci/run installs as the README's install line does and runs the README's test command, nothing else."""
    (install,) = [b for b in blocks("README.md") if b.key[1].startswith("bash scripts/install.sh")]
    (tests,) = [b for b in blocks("README.md") if b.key[1] == "python3 -m pytest"]
    ci = [c for c in commands((ROOT / ".ci/run").read_text()) if not c.startswith(("set ", "export ", "cd "))]
    assert ci == [install.key[1].split(" && ")[0], *commands(tests.text)]


def test_the_readme_command_list_is_the_cli():
    """The README's list of commands names every `k3post` sub-command, and only those."""
    from k3post.cli import build_parser

    listing = [b for b in blocks("README.md", ("",)) if b.text.startswith("k3post demo [CONFIG]")]
    assert len(listing) == 1
    listed = set(re.findall(r"^k3post ([a-z][a-z-]*)", listing[0].text, re.M))
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    assert listed == set(sub.choices)


# ------------------------------------------------------------------------------------------------ the runner

class Shell:
    """Runs a doc's commands in ``cwd`` as a user's terminal would (see the module docstring)."""

    def __init__(self, cwd: Path, sizes: tuple[str, ...] = (), where: str = ""):
        self.cwd, self.where, self.background, self.times = cwd, where, [], []
        if os.environ.get("K3POST_DOCS_AS_WRITTEN") == "1":
            sizes = ()
        (cwd / "configs").symlink_to(ROOT / "configs")
        bin_dir = cwd / ".docs-bin"
        bin_dir.mkdir()
        (bin_dir / "sizes").write_text("".join(f"{o}\n" for o in sizes))
        stages = "|".join(STAGES)
        (bin_dir / "k3post").write_text(
            "#!/usr/bin/env bash\nextra=()\n"
            f'case "$1" in {stages}) mapfile -t extra < {shlex.quote(str(bin_dir / "sizes"))};; esac\n'
            f'exec {shlex.quote(sys.executable)} -m k3post.cli "$@" "${{extra[@]}}"\n')
        (bin_dir / "k3post").chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                    "K3POST_CACHE": str(cwd / ".cache")}
        self.logs = cwd / ".docs-logs"
        self.logs.mkdir()

    def _log(self) -> Path:
        return self.logs / f"{len(self.times):02d}.log"

    def run(self, cmd: str, rc: int = 0, timeout: float = 3600) -> None:
        t0 = time.perf_counter()
        if re.match(r"k3post serve\b", cmd) and not cmd.rstrip().endswith("&"):
            self._serve(cmd, timeout)
        else:
            log = self._log()
            with log.open("w") as out:
                p = subprocess.Popen(["bash", "-c", cmd], cwd=self.cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
                if cmd.rstrip().endswith("&"):
                    self.background.append(p.pid)  # the session holds what the doc left running
                try:
                    got = p.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    raise AssertionError(f"{self.where}: {cmd!r} still running after {timeout:.0f} s; "
                                         f"its output: {log}") from None
            tail = log.read_text()[-4000:]
            assert got == rc, f"{self.where}: {cmd!r} exited {got}, the doc expects {rc}:\n{tail}"
        self._time(cmd, time.perf_counter() - t0)

    def _serve(self, cmd: str, timeout: float) -> None:
        port = int(m.group(1)) if (m := re.search(r"--port[ =](\d+)", cmd)) else 8000
        log = self._log()
        with log.open("w") as out:
            p = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=self.cwd, env=self.env, stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + timeout
            while True:
                assert p.poll() is None, f"{self.where}: {cmd!r} exited {p.returncode}:\n{log.read_text()[-4000:]}"
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"{self.where}: {cmd!r} not serving after {timeout:.0f} s"
                time.sleep(0.5)
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
                "model": model, "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 8})
            assert r.status_code == 200 and r.json()["choices"][0]["message"], (self.where, cmd, r.text[:500])
        finally:
            os.killpg(p.pid, signal.SIGINT)  # Ctrl-C
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def _time(self, cmd: str, seconds: float) -> None:
        row = {"where": self.where, "command": cmd, "seconds": round(seconds, 1)}
        self.times.append(row)
        print(f"[docs] {seconds:7.1f} s  {cmd}")
        if path := os.environ.get("K3POST_DOCS_TIMES"):
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def run_block(self, block: Block, spec: Run) -> None:
        text = block.text
        for old, new in spec.subs:
            assert old in text, f"{block.file}:{block.line}: BLOCKS substitutes {old!r}, which the block lacks"
            text = text.replace(old, new)
        expect = dict(spec.expect)
        for cmd in commands(text):
            self.run(cmd, rc=next((c for s, c in expect.items() if s in cmd), 0))

    def close(self) -> None:
        for pgid in self.background:
            try:
                os.killpg(pgid, signal.SIGINT)
            except ProcessLookupError:
                continue
        time.sleep(2)
        for pgid in self.background:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture()
def shell(tmp_path, request):
    shells = []

    def make(sizes: tuple[str, ...] = (), where: str = "") -> Shell:
        shells.append(Shell(tmp_path, sizes, where or request.node.name))
        return shells[-1]

    yield make
    for s in shells:
        s.close()


def _sft_run(tmp_path_factory, recipe: str) -> Path:
    """``runs/<recipe>/sft/final`` as `k3post demo configs/<recipe>.yaml` leaves it, at toy size (`k3post sft`)."""
    cwd = tmp_path_factory.mktemp(f"{recipe}-sft")
    sh = Shell(cwd, TOY_DEMO, f"{recipe}_sft fixture")
    sh.run(f"k3post sft configs/{recipe}.yaml run.name={recipe}")
    assert (cwd / f"runs/{recipe}/sft/final/config.json").is_file()
    return cwd / "runs" / recipe


@pytest.fixture(scope="module")
def demo_sft(tmp_path_factory) -> Path:
    return _sft_run(tmp_path_factory, "demo")


@pytest.fixture(scope="module")
def full_sft(tmp_path_factory) -> Path:
    return _sft_run(tmp_path_factory, "full")


def _slow(speed: str):
    return [pytest.mark.slow] if speed == "slow" else []


_SINGLE = [pytest.param(k, marks=_slow(v.speed), id=f"{k[0]}:{k[1][:48]}") for k, v in BLOCKS.items()
           if isinstance(v, Run) and k[0] != _OWN]


@pytest.mark.parametrize("key", _SINGLE)
def test_block_runs_as_written(key, shell, request):
    spec = BLOCKS[key]
    block = _block(key)
    sh = shell(spec.sizes, f"{block.file}:{block.line}")
    for need in spec.needs:  # a copy: the doc's commands may write into the run, as a user's would
        shutil.copytree(request.getfixturevalue(need), sh.cwd / "runs" / need.removesuffix("_sft"), symlinks=True)
    sh.run_block(block, spec)


# ------------------------------------------------------------------------- your own model, as the doc says

def _own_folders(cwd: Path, families: dict[str, str]) -> None:
    for name, family in families.items():
        save_user_model(family, cwd / "models" / name)


def test_add_tokens_and_synth_on_your_own_tokenizer(shell):
    """The doc's first block: `add-tokens` writes a copy whose tokenizer has the XTML tokens, and `synth` with it
    writes the 240 samples the doc says (80 tasks x 3 efforts)."""
    key = (_OWN, "k3post add-tokens /models/my-llama /models/my-llama-xtml")
    sh = shell(where=f"{_OWN}:{_block(key).line}")
    _own_folders(sh.cwd, {"my-llama": "llama"})
    sh.run_block(_block(key), BLOCKS[key])
    from k3post.tokenizer import load_tokenizer

    assert len(load_tokenizer(sh.cwd / "models/my-llama-xtml", require_xtml=True)) > len(
        load_tokenizer(sh.cwd / "models/my-llama"))
    assert len((sh.cwd / "data/sft.jsonl").read_text().splitlines()) == 240


# A dense model has no experts: the doc says to set qat.enabled false, and its MXFP4 export is an error (exit 2)
_OWN_MODELS = {
    "gpt_oss": ((), ()),
    "qwen3_moe": ((("/models/my-gpt-oss", "/models/my-qwen3-moe"),), ()),
    "llama": ((("/models/my-gpt-oss", "/models/my-dense-llama"), ("enabled: true", "enabled: false")),
              (("out/my-model-mxfp4", 2),)),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(_OWN_MODELS))
def test_post_train_your_own_model(family, shell):
    """docs/post-train-your-own-model.md from top to bottom on a tiny model of ``family`` saved with a
    tokenizer of the user's own: add the XTML tokens and synthesize data, write the doc's config, then every
    stage, serve, export, report and status."""
    subs, expect = _OWN_MODELS[family]
    sh = shell(_OWN_SIZES, f"{_OWN} ({family})")
    folder = {"gpt_oss": "my-gpt-oss", "qwen3_moe": "my-qwen3-moe", "llama": "my-dense-llama"}[family]
    _own_folders(sh.cwd, {"my-llama": "llama", folder: family})
    first = (_OWN, "k3post add-tokens /models/my-llama /models/my-llama-xtml")
    sh.run_block(_block(first), BLOCKS[first])
    (config,) = [b for b in blocks(_OWN, ("yaml",)) if b.text.startswith("# my-model.yaml\n")]
    text = config.text
    for old, new in (*subs, ("/models/", "models/")):
        assert old in text, (old, f"{_OWN}:{config.line}")
        text = text.replace(old, new)
    (sh.cwd / "my-model.yaml").write_text(text)
    stages = (_OWN, "k3post sft my-model.yaml")
    sh.run_block(_block(stages), Run("slow", expect=expect))
    run = sh.cwd / "runs" / "my-model"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "done", summary
    for rel in ("sft/final/config.json", "mopd/final/config.json", "report.html"):
        assert (run / rel).exists(), rel
    exported = sh.cwd / "out" / "my-model-mxfp4"
    assert exported.is_dir() == (family != "llama")
    assert (sh.cwd / "out" / "my-model-bf16" / "config.json").is_file()


def test_extending_snippets_are_what_k3post_reads(tmp_path):
    """docs/extending.md's YAML is a config `k3post` loads with the values it says, and its entry-point table names
    the group the family registry reads."""
    import tomllib

    import yaml

    from k3post.config import load_config
    from k3post.envs.families.registry import PLUGIN_GROUP

    (loss,) = blocks("docs/extending.md", ("yaml",))
    cfg_file = tmp_path / "dapo.yaml"
    cfg_file.write_text(loss.text)
    rl = load_config(cfg_file).rl
    want = yaml.safe_load(loss.text)["rl"]["loss"]
    assert {k: getattr(rl.loss, k) for k in want} == want and rl.loss.clip_eps_high == 0.28
    (toml,) = blocks("docs/extending.md", ("toml",))
    assert list(tomllib.loads(toml.text)["project"]["entry-points"]) == [PLUGIN_GROUP]
