"""`k3post.urls.is_url`: the one test for "an endpoint, not a model folder" that configs, MOPD teachers, the judge,
run-input checks and the HTTP engine share."""

import pytest

from k3post.config.rl import RLConfig
from k3post.config.rollout import EngineConfig
from k3post.urls import is_url


@pytest.mark.parametrize("value, expected", [
    ("http://127.0.0.1:8000", True), ("https://host/v1", True), ("HTTPS://HOST", True),
    ("runs/demo/experts/general.max", False), ("/models/http://x", False), ("ftp://host", False),
    ("http:/missing-slash", False), ("", False), (None, False), (8000, False), (["http://x"], False),
])
def test_is_url(value, expected):
    assert is_url(value) is expected


def test_configs_use_it():
    with pytest.raises(ValueError, match="rl.judge is a URL: set rl.judge_model"):
        RLConfig(judge="HTTP://judge:8000")
    RLConfig(judge="runs/x/sft/final")  # a folder needs no model name
    with pytest.raises(ValueError):
        EngineConfig(kind="http", urls=["localhost:8000"])
