"""`bench/reference_effort.py`: reference-solution token counts per effort (exact counts, no timing)."""


from k3post.xtml import XTML

from tests.bench_module import load_bench

bench = load_bench("reference_effort")


def test_reference_effort_counts(xtml_tokenizer):
    """Low-effort references think nothing and are shorter than max ones; thinking is part of the
    assistant tokens; every effort is measured."""
    m = bench.measure(XTML(xtml_tokenizer), "coding.write_function", 3, 0)
    assert set(m) == {"low", "high", "max"}
    assert m["low"]["think_tokens"] == 0 < m["high"]["think_tokens"] < m["max"]["think_tokens"]
    assert 0 < m["low"]["assistant_tokens"] < m["max"]["assistant_tokens"]
    assert all(v["think_tokens"] < v["assistant_tokens"] for v in m.values())
