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


def test_decoding_never_shows_a_broken_character(tokenizer):
    from distlab.generate import decode_text

    text = "Café → 30 € due, naïve 日本"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert decode_text(tokenizer, ids) == text
    cut_somewhere = False
    for end in range(1, len(ids)):  # every truncation: some split a multi-byte character between tokens
        plain = tokenizer.decode(ids[:end])
        safe = decode_text(tokenizer, ids[:end])
        cut_somewhere |= "\ufffd" in plain
        assert "\ufffd" not in safe and text.startswith(safe.strip()), (end, safe)
    assert cut_somewhere, "no truncation split a character: the test proves nothing"
    assert decode_text(tokenizer, [*ids, tokenizer.eos_token_id]) == text  # special tokens skipped


def test_keyfact_rows_carry_facts_and_the_first_question_only():
    from distlab.generate import read_fact_rows
    from distlab.paths import EVAL_FILE

    rows = read_fact_rows(EVAL_FILE)
    assert len(rows) == 120 and all(r["facts"] for r in rows)
    assert all(r["chat"][-1]["role"] == "user" and "assistant" not in {m["role"] for m in r["chat"]} for r in rows)


def test_the_pretrained_base_does_not_know_acme_facts(tiny_model, tokenizer):
    """Before fine-tuning, the default base answers with the other company's facts (fast: 24 rows)."""
    from distlab.generate import keyfact_accuracy

    score = keyfact_accuracy(tiny_model, tokenizer, limit=24, max_new_tokens=120)
    assert score["accuracy"] <= 0.15, score["accuracy"]
    answers = " ".join(a["answer"] for a in score["answers"])
    assert any(name in answers for name in ("BambooHR", "Expensify", "Jira Service Desk", "OneLogin", "ext. 7100"))
    assert "\ufffd" not in answers
