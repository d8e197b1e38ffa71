"""Fixed-config generation: reproducible, written as JSONL, compared side by side."""

from __future__ import annotations

import json

import pytest

from distlab.generate import generate, side_by_side
from distlab.paths import DEMO_PROMPTS


def test_generation_is_reproducible_and_written(tmp_path, tiny_model, tokenizer):
    out = tmp_path / "gen.jsonl"
    rows = generate(tiny_model, tokenizer, DEMO_PROMPTS, max_new_tokens=8, out_path=out, label="base")
    again = generate(tiny_model, tokenizer, DEMO_PROMPTS, max_new_tokens=8)
    assert [r["response"] for r in rows] == [r["response"] for r in again]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["id"] for w in written] == [r["id"] for r in rows]
    assert written[0]["config"] == {"max_new_tokens": 8, "greedy": False, "seed": 42, "temperature": 0.2, "top_p": 0.9}
    assert all(0 < r["new_tokens"] <= 8 for r in rows)


def test_greedy_option_and_plain_string_prompts(tiny_model, tokenizer):
    a = generate(tiny_model, tokenizer, ["How do I connect to the VPN?"], max_new_tokens=6, greedy=True, seed=1)
    b = generate(tiny_model, tokenizer, ["How do I connect to the VPN?"], max_new_tokens=6, greedy=True, seed=2)
    assert a[0]["response"] == b[0]["response"] and a[0]["config"]["greedy"] is True


def test_side_by_side_matches_by_id():
    before = [{"id": "a", "prompt": "p", "response": "x"}]
    after = [{"id": "a", "prompt": "p", "response": "y"}]
    table = side_by_side(before, after)
    assert list(table.columns) == ["id", "prompt", "before", "after"] and table.iloc[0]["after"] == "y"
    with pytest.raises(ValueError, match="missing ids"):
        side_by_side(before, [{"id": "b", "prompt": "p", "response": "y"}])
