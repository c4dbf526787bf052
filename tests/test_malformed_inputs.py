"""Every class of malformed input gives an error with an exact message naming the file, line or key, and
changes nothing on disk (issue 20): configs, SFT JSONL data, synth JSONL, draft samples, mix configs,
skill files, tool-call arguments, and checkpoints with missing, extra or mismatched tensors (the model
they were to be loaded into is left as it was, too).

Shape legend: none.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from k3post.cli import main
from k3post.config import ConfigError, load_config
from k3post.data import DataError, load_sft_jsonl
from k3post.xtml import XTML, parse_tool_arguments

GOOD = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'


def snapshot(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under root (folders as "dir")."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(root.rglob("*"))}  # fmt: skip


def raises_unchanged(root: Path, exc: type[BaseException], message: str, fn: Any, *args: Any, **kw: Any) -> None:
    """fn raises exc with exactly ``message``, and nothing under root changed."""
    before = snapshot(root)
    with pytest.raises(exc) as e:
        fn(*args, **kw)
    assert str(e.value) == message
    assert snapshot(root) == before


# --------------------------------------------------------------------------- SFT JSONL


def _msgs(asst: str) -> bytes:
    return b'{"messages": [{"role": "user", "content": "hi"}, ' + asst.encode() + b"]}"


SFT_BAD = [
    (b'{"messages": [', "malformed JSON at column 15: Expecting value", "malformed_json"),
    (b'{"messages": "\xff"}', "not valid UTF-8 at byte 14", "malformed_json"),
    (b"[" * 100_000, "malformed JSON: nested too deeply", "malformed_json"),
    (b'{"n": 1' + b"0" * 5000 + b"}", "malformed JSON: Exceeds the limit (4300 digits) for integer string conversion: "
     "value has 5001 digits; use sys.set_int_max_str_digits() to increase the limit", "malformed_json"),
    (b"[1]", "a record must be a JSON object, got list", "invalid_record"),
    (b'{"messages": []}', "key 'messages' must be a non-empty list", "invalid_record"),
    (_msgs('{"role": "assistant", "content": "x", "tool_calls": "f"}'),
     "messages[1].tool_calls must be a list, got str", "invalid_record"),
    (_msgs('{"role": "assistant", "content": "x", "tool_calls": [5]}'),
     "messages[1].tool_calls[0] must be an object with a 'function' object", "invalid_record"),
    (_msgs('{"role": "assistant", "content": "x", "tool_calls": [{"function": "f"}]}'),
     "messages[1].tool_calls[0] must be an object with a 'function' object", "invalid_record"),
    (b'{"tools": [{"function": "f"}], ' + _msgs('{"role": "assistant", "content": "x"}')[1:],
     "", "ok"),  # a malformed spec declares nothing; the record itself renders
    (_msgs('{"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}'),
     "messages[1].tool_calls[0]: call to undeclared tool 'f'; declared: []", "invalid_record"),
    (b'{"messages": [{"role": "user", "content": 5}]}',
     "message 0 (user): content must be a string, a list of content parts or None, got int", "invalid_record"),
    (b'{"messages": [{"role": "robot", "content": "x"}]}',
     "messages[0]: unknown role 'robot'; expected one of ('system', 'user', 'assistant', 'tool')", "invalid_record"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', "sample has no trainable (assistant) tokens",
     "no_trainable_tokens"),
]  # fmt: skip


@pytest.fixture(scope="module")
def x(xtml_tokenizer: PreTrainedTokenizerFast) -> XTML:
    return XTML(xtml_tokenizer)


@pytest.mark.parametrize("line, message, reason", SFT_BAD, ids=[f"{r}-{k}" for k, (_, _, r) in enumerate(SFT_BAD)])
def test_sft_jsonl(tmp_path: Path, x: XTML, line: bytes, message: str, reason: str) -> None:
    """Line 2 is bad: the error names file:line exactly (invalid UTF-8, nesting the JSON parser cannot
    recurse into, over-long integers and tool_calls of the wrong shape used to escape as
    UnicodeDecodeError / RecursionError / a bare ValueError / AttributeError); ``skip`` counts it."""
    path = tmp_path / "data.jsonl"
    path.write_bytes(GOOD + line + b"\n" + GOOD)
    if reason == "ok":
        assert len(load_sft_jsonl(path, x, max_len=10_000)[0]) == 3
        return
    raises_unchanged(tmp_path, DataError, f"{path}:2: {message}", load_sft_jsonl, path, x, max_len=10_000)
    samples, stats = load_sft_jsonl(path, x, max_len=10_000, on_bad_sample="skip")
    assert (len(samples), stats.skipped) == (2, {reason: 1})


def test_sft_jsonl_missing_and_empty(tmp_path: Path, x: XTML) -> None:
    raises_unchanged(tmp_path, DataError, f"{tmp_path / 'no.jsonl'}: SFT data file not found",
                     load_sft_jsonl, tmp_path / "no.jsonl", x, max_len=100)  # fmt: skip
    (tmp_path / "empty.jsonl").write_bytes(b"\n \n")
    raises_unchanged(tmp_path, DataError, f"{tmp_path / 'empty.jsonl'}: no usable samples (0 read, skipped {{}})",
                     load_sft_jsonl, tmp_path / "empty.jsonl", x, max_len=100)  # fmt: skip


# --------------------------------------------------------------------------- configs

CONFIG_BAD = [
    (b"sft:\n  lr: 1.0e-3\nsft:\n  lr: 2.0e-3\n", "invalid YAML: duplicate key 'sft' (line 3)"),
    (b"sft:\n  lr: 1.0e-3\n  lr: 2.0e-3\n", "invalid YAML: duplicate key 'lr' (line 3)"),
    (b"sft:\n  lr: \xff\n", "not valid UTF-8 at byte 11"),
    (b"- 1\n", "top level must be a mapping, got list"),
    (b"sft:\n  lrr: 1\n", "unknown config key 'sft.lrr' (did you mean 'sft.lr'?)"),
    (b"sft: 3\n", "'sft' is a section; give it a mapping, not 3"),
    (b"sft:\n  lr: -1.0\n", "sft.lr must be a number >= 0, got -1.0"),
    (b"rl:\n  rollout:\n    lambda_: 1.5\n", "rl.rollout.lambda_ must be in (0, 1], got 1.5"),
    (b"mopd:\n  rl:\n    rollout: {k: 0}\n", "mopd.rl.rollout.k must be an integer >= 1, got 0"),
    (b"eval:\n  temperature: .nan\n", "eval.temperature must be a number >= 0, got nan"),
    (b"data:\n  difficulty: 0\n", "data.difficulty must be an integer >= 1, got 0"),
    (b"mopd:\n  rl:\n    lr: 1.0e-3\n", "'mopd.rl.lr' is now 'mopd.rl.optim.lr' (an RL stage's rollout, optimizer and loss "
                                        "settings have sections of their own)"),
]  # fmt: skip


@pytest.mark.parametrize("text, message", CONFIG_BAD, ids=["dup-section", "dup-key", "utf8", "list", "unknown", "section",
                                                           "range-lr", "range-lambda", "range-nested", "range-nan",
                                                           "range-int", "moved"])
def test_config_file(tmp_path: Path, text: bytes, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """load_config and the command line (``k3post sft CONFIG``: exit 2, one line, no run folder made)."""
    path = tmp_path / "cfg.yaml"
    path.write_bytes(text)
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}: {message}"), str(e.value)
    assert main(["sft", str(path), f"run.root={tmp_path}", "run.name=run"]) == 2
    assert capsys.readouterr().err.startswith(f"k3post: error: {path}: {message}")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("override, message", [
    ("rl.keep_last=0", "rl.keep_last must be an integer >= 1 (checkpoints kept on disk), got 0"),
    ("sft.keep_last=-3", "sft.keep_last must be an integer >= 1 (checkpoints kept on disk), got -3"),
    ("rl.domain_overrides.agents.steps=-2", "rl.domain_overrides.agents.steps must be an integer >= 0, got -2"),
    ("rl.domain_overrides.coding.rollout.lambda_=0", "rl.domain_overrides.coding.rollout.lambda_ must be in (0, 1], got 0.0"),
    ("rl.domain_overrides.general.optim.lr_schedule=cosine",
     "rl.domain_overrides.general.optim.lr_schedule: must be one of ('constant', 'linear'), got 'cosine'"),
    ("rl.domain_overrides.general.optim.lr=fast", "rl.domain_overrides.general.optim.lr: must be a number, got 'fast'"),
    ("sft.steps=0", "override 'sft.steps=0': sft.steps must be an integer >= 1, got 0"),
])  # fmt: skip
def test_config_ranges_on_the_command_line(tmp_path: Path, override: str, message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Out-of-range overrides: the error names the key, the range and the value (exit 2, no run folder)."""
    with pytest.raises(ValueError) as e:
        load_config(None, [override])
    assert str(e.value) == message
    path = tmp_path / "cfg.yaml"
    path.write_text("run: {name: r}\n")
    before = snapshot(tmp_path)
    assert main(["sft", str(path), override, f"run.root={tmp_path}"]) == 2
    assert capsys.readouterr().err == f"k3post: error: {message}\n"
    assert snapshot(tmp_path) == before


def test_config_values_and_overrides() -> None:
    with pytest.raises(ConfigError, match=r"^override 'sft.max_len=1.5': bad value for 'sft.max_len': Value '1.5' of type "
                                          r"'float' could not be converted to Integer"):  # fmt: skip
        load_config(None, ["sft.max_len=1.5"])
    with pytest.raises(ConfigError, match=r"^override 'sft.lr': expected KEY=VALUE, e.g. sft.lr=3e-4$"):
        load_config(None, ["sft.lr"])


# --------------------------------------------------------------------------- other inputs: synth JSONL, drafts, mix, skills


def test_synth_jsonl_and_torn_multibyte_line(tmp_path: Path) -> None:
    from k3post.io import read_jsonl

    p = tmp_path / "s.jsonl"
    for bad, msg in [(b'{"a": "\xff"}', "not valid UTF-8 at byte 7"), (b"[" * 100_000, "malformed JSON: nested too deeply"),
                     (b"[1]", "a record must be a JSON object, got list")]:  # fmt: skip
        p.write_bytes(b'{"a": 1}\n' + bad + b"\n")
        raises_unchanged(tmp_path, ValueError, f"{p}:2: {msg}", read_jsonl, p)
    # a crash mid-write cut the last line inside a multi-byte character: repaired like any torn line
    p.write_bytes('{"a": 1}\n{"b": "é'.encode()[:-1])
    assert read_jsonl(p, repair=True) == [{"a": 1}] and p.read_bytes() == b'{"a": 1}\n'


def test_draft_samples(tmp_path: Path) -> None:
    from k3post.spec.data import load_samples

    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"ids": [1], "mask": [1]}\n\xff\n')
    raises_unchanged(tmp_path, ValueError, f"{p}:2: not valid UTF-8 at byte 0", load_samples, p)
    p.write_bytes(b'{"ids": [1], "mask": [1]}\n{"ids": [1]}\n')
    raises_unchanged(tmp_path, ValueError, f"{p}:2: not a draft sample ('mask')", load_samples, p)


def test_mix_config_and_skill_files(tmp_path: Path) -> None:
    from k3post.envs.harness import load_skill_file
    from k3post.errors import UserError
    from k3post.synth.mix import load_mix_config

    mix = tmp_path / "mix.yaml"
    mix.write_bytes(b"n: 5\nn: 6\n")
    raises_unchanged(tmp_path, ValueError, f"{mix}: invalid YAML: duplicate key 'n' (line 2)\n"
                     '  in "<unicode string>", line 2, column 1:\n    n: 6\n    ^', load_mix_config, mix)  # fmt: skip
    mix.write_bytes(b"seeds: 5\n")
    with pytest.raises(UserError, match=r"unknown mix config key 'seeds' \(did you mean 'seed'\?\)"):
        load_mix_config(mix)
    skill = tmp_path / "s.md"
    for text, msg in [(b"---\nname: a\n---\n\xff", "not valid UTF-8 at byte 16"),
                      (b"---\nname: a\n", "front matter opened with '---' is never closed"),
                      (b"---\nname a\n---\nbody", "front matter line 'name a' is not 'key: value'"),
                      (b"---\nnam: a\n---\nbody", "unknown front matter keys ['nam'] (valid: name, description, tools)")]:  # fmt: skip
        skill.write_bytes(text)
        raises_unchanged(tmp_path, ValueError, f"{skill}: {msg}", load_skill_file, skill)


# --------------------------------------------------------------------------- tool-call arguments

TOOL_ARGS_BAD = [
    ("{oops", "tool call arguments are not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ("[1]", "tool call arguments are not a JSON object"),
    ("null", "tool call arguments are not a JSON object"),
    ('{"a": NaN}', "tool call arguments are not valid JSON: NaN is not valid JSON"),
    ('{"a": 1e999}', "tool call arguments are not valid JSON: 1e999 is out of range for a JSON number"),
    ("[" * 50_000, "tool call arguments are not valid JSON: JSON nested too deeply"),
    (5, "tool call arguments must be a JSON string or a dict, got int"),
    (None, "tool call arguments must be a JSON string or a dict, got NoneType"),
]  # fmt: skip


@pytest.mark.parametrize("args, message", TOOL_ARGS_BAD, ids=range(len(TOOL_ARGS_BAD)))
def test_tool_call_arguments(args: Any, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_tool_arguments({"function": {"name": "f", "arguments": args}})
    assert str(e.value) == message


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from k3post.recipes.commands import init_model

    return init_model(tmp_path_factory.mktemp("ckpt") / "model", preset="tiny", vocab_size=300)


Q = "model.layers.0.self_attn.q_proj.weight"
CKPT_BAD = [
    ("missing", lambda t: t.pop(Q), f"weights do not match the model (missing ['{Q}'], unexpected [])"),
    ("extra", lambda t: t.__setitem__("model.bogus.weight", torch.zeros(3)),
     "weights do not match the model (missing [], unexpected ['model.bogus.weight'])"),
    ("shape", lambda t: t.__setitem__(Q, torch.zeros(3, 3)), f"tensor {Q} has shape (3, 3), the model expects (128, 128)"),
    ("truncated", None, "cannot load the checkpoint's weights: Error while deserializing header: incomplete metadata, "
     "file not fully covered"),
]  # fmt: skip


@pytest.mark.parametrize("name, edit, message", CKPT_BAD, ids=[c[0] for c in CKPT_BAD])
def test_checkpoint_tensors(tmp_path: Path, tiny_ckpt: Path, name: str, edit: Any, message: str) -> None:
    """`load_weights_into` refuses a checkpoint whose tensors do not match the model, by name, and leaves
    the model untouched. A missing tensor used to load silently: from_pretrained re-initialised it at
    random and that was copied into the model."""
    from safetensors.torch import load_file, save_file

    from k3post.checkpoint import load_weights_into
    from k3post.models import load_model

    bad = tmp_path / name
    shutil.copytree(tiny_ckpt, bad)
    weights = bad / "model.safetensors"
    if edit is None:
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        tensors = load_file(weights)
        edit(tensors)
        save_file(tensors, weights, metadata={"format": "pt"})
    model = load_model(tiny_ckpt, "float32")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    raises_unchanged(tmp_path, ValueError, f"{bad}: {message}", load_weights_into, model, bad)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    load_weights_into(model, tiny_ckpt)  # the intact folder still loads


# --------------------------------------------------------------------------- usage errors of the other commands


@pytest.mark.parametrize("argv, message", [
    (["synth", "--family", "general.arithmetc", "--n", "1", "--out", "{tmp}/s.jsonl"],
     "--family: unknown task family 'general.arithmetc' (did you mean 'general.arithmetic'?); known: ["),
    (["tasks", "sample", "coding.write_functio"],
     "unknown task family 'coding.write_functio' (did you mean 'coding.write_function'?); known: ["),
    (["tasks", "sample", "coding.write_function", "--difficulty", "9"], "difficulty must be an int in 1..3, got 9"),
    (["mix", "--in", "{tmp}/missing.jsonl", "--out", "{tmp}/m.jsonl"], "{tmp}/missing.jsonl: file not found"),
])  # fmt: skip
def test_usage_errors_exit_2_and_write_nothing(tmp_path: Path, argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown family, a difficulty the family lacks, a missing input: exit 2 with the one line (not 1,
    "this is not an input error"), and nothing written."""
    before = snapshot(tmp_path)
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3post: error: " + message.replace("{tmp}", str(tmp_path))), err
    assert snapshot(tmp_path) == before
