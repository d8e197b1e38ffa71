"""The data contract: every accepted format, every kind of bad input, masking and packing."""

from __future__ import annotations

import json

import pytest

from distlab.data import (
    IGNORE_INDEX,
    DataError,
    build_sft_data,
    collate,
    load_jsonl,
    load_prompts,
    pack_examples,
    tokenize_conversations,
)


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = [
    {"prompt": "How do I reset my password?", "response": "Use the self-service portal."},
    {"question": "Where is the VPN client?", "answer": "In the software center.", "id": "q1", "category": "vpn"},
    {"messages": [{"role": "system", "content": "You are the helpdesk."},
                  {"role": "user", "content": "My laptop broke."},
                  {"role": "assistant", "content": "Open a hardware ticket."},
                  {"role": "user", "content": "Which form?"},
                  {"role": "assistant", "content": "Form HW-2."}]},
]


def test_all_three_formats_mix_in_one_file(tmp_path):
    convs = load_jsonl(write_rows(tmp_path / "mix.jsonl", GOOD))
    assert [c.format for c in convs] == ["prompt/response", "question/answer", "messages"]
    assert convs[0].messages == [{"role": "user", "content": GOOD[0]["prompt"]},
                                 {"role": "assistant", "content": GOOD[0]["response"]}]
    assert convs[1].id == "q1"
    assert len(convs[2].messages) == 5
    summary = convs.summaries[0]
    assert summary.rows == 3 and sum(summary.by_format.values()) == 3
    assert "3 rows read" in str(summary)


BAD_ROWS = [
    ('{"prompt": "hi", "response": "x"', "<row>", "invalid JSON"),
    ({"text": "hello"}, "<row>", "unknown format"),
    ({"prompt": "a", "answer": "b"}, "<row>", "unknown format"),
    ({"prompt": "a", "response": "b", "extra": 1}, "extra", "unknown field"),
    ({"prompt": "a"}, "response", "missing"),
    ({"prompt": "   ", "response": "b"}, "prompt", "empty"),
    ({"question": "a", "answer": 3}, "answer", "must be a string"),
    ({"messages": "hi"}, "messages", "must be a list"),
    ({"messages": []}, "messages", "is empty"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "unknown role"),
    ({"messages": [{"role": "user", "content": "x"}]}, "messages", "no assistant turn"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages", "no user turn"),
    ({"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "y"}]},
     "messages[0].content", "must be a string"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]}, "messages[0].content", "missing"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "s"},
                   {"role": "assistant", "content": "y"}]}, "messages[1].role", "only come first"),
    ([1, 2], "<row>", "JSON object"),
]


@pytest.mark.parametrize("row,field,reason", BAD_ROWS, ids=[b[2] + f"-{i}" for i, b in enumerate(BAD_ROWS)])
def test_bad_row_names_file_line_and_field(tmp_path, row, field, reason):
    path = write_rows(tmp_path / "bad.jsonl", [GOOD[0], row])
    with pytest.raises(DataError) as info:
        load_jsonl(path)
    err = info.value
    assert (err.path, err.line, err.field) == (str(path), 2, field)
    assert reason in err.reason
    assert f"{path}:2: field '{field}'" in str(err)


def test_every_bad_row_is_reported_not_just_the_first(tmp_path):
    path = write_rows(tmp_path / "bad.jsonl", [GOOD[0], {"text": 1}, GOOD[1], "{oops", {"prompt": "a"}])
    with pytest.raises(DataError) as info:
        load_jsonl(path)
    assert info.value.line == 2
    assert [e.line for e in info.value.others] == [4, 5]
    assert "2 more error(s)" in str(info.value)


def test_empty_file_and_blank_only_file(tmp_path):
    for content in ("", "\n\n  \n"):
        path = tmp_path / "empty.jsonl"
        path.write_text(content)
        with pytest.raises(DataError, match="empty file") as info:
            load_jsonl(path)
        assert info.value.line == 0


def test_non_utf8_bytes_name_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    latin1_row = '{"prompt": "caf\xe9", "response": "x"}'.encode("latin-1")
    path.write_bytes(json.dumps(GOOD[0]).encode() + b"\n" + latin1_row + b"\n")
    with pytest.raises(DataError, match="not valid UTF-8") as info:
        load_jsonl(path)
    assert info.value.line == 2


def test_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="cannot read"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_blank_lines_are_counted_not_silently_dropped(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_text(json.dumps(GOOD[0]) + "\n\n" + json.dumps(GOOD[1]) + "\n")
    convs = load_jsonl(path)
    assert len(convs) == 2 and convs.summaries[0].blank_lines == 1
    assert convs[1].line == 3


def test_prompts_do_not_need_an_answer(tmp_path):
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": "Hi?", "id": "p1"},
                                             {"messages": [{"role": "user", "content": "Yo"}]}])
    prompts = load_prompts(path)
    assert [c.messages[-1]["role"] for c in prompts] == ["user", "user"]
    with pytest.raises(DataError):
        load_jsonl(path)


def test_every_prompt_has_an_id_and_its_facts(tmp_path):
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": "Hi?", "id": "p1", "facts": ["Okta"]}, {"prompt": "Yo"}])
    prompts = load_prompts(path)
    assert [(c.id, c.facts) for c in prompts] == [("p1", ["Okta"]), ("prompt-1", [])]


@pytest.mark.parametrize("rows, where", [
    ([{"id": "p1", "prompt": "Hi", "facts": ["Okta"]}, {"id": "p2", "prompt": "Ho", "facts": [""]}],
     r"p.jsonl:2: field 'facts': .*must be a list of non-empty strings"),
    ([{"id": "same", "prompt": "Hi"}, {"prompt": "Ho"}, {"id": "same", "prompt": "He"}],
     r"p.jsonl:3: field 'id': prompt id 'same' appears more than once \(first on line 1\)"),
])
def test_a_bad_prompt_file_is_one_error_naming_file_line_and_field(tmp_path, rows, where):
    with pytest.raises(DataError, match=where):
        load_prompts(write_rows(tmp_path / "p.jsonl", rows))


def test_loss_only_on_assistant_tokens(tmp_path, tokenizer):
    convs = load_jsonl(write_rows(tmp_path / "mix.jsonl", GOOD))
    examples, _ = tokenize_conversations(convs, tokenizer, seq_len=512)
    for conv, ex in zip(convs, examples):
        learned = tokenizer.decode([t for t, lab in zip(ex.input_ids, ex.labels) if lab != IGNORE_INDEX])
        replies = [m["content"] for m in conv.messages if m["role"] == "assistant"]
        # Exactly the replies, each followed by the end-of-turn marker, and nothing of the prompt.
        assert learned == "".join(r + "<|im_end|>\n" for r in replies)
        masked = tokenizer.decode([t for t, lab in zip(ex.input_ids, ex.labels) if lab == IGNORE_INDEX])
        for m in conv.messages:
            if m["role"] != "assistant":
                assert m["content"] in masked


def test_overlong_policies_are_explicit_and_counted(tmp_path, tokenizer):
    long = {"prompt": "Explain the policy.", "response": " ".join(["policy"] * 400)}
    path = write_rows(tmp_path / "long.jsonl", [GOOD[0], long])
    convs = load_jsonl(path)
    kept, summary = tokenize_conversations(convs, tokenizer, seq_len=64, overlong="truncate")
    assert len(kept) == 2 and summary.truncated == 1 and max(len(e.input_ids) for e in kept) == 64
    kept, summary = tokenize_conversations(convs, tokenizer, seq_len=64, overlong="reject")
    assert len(kept) == 1 and summary.rejected == 1 and f"{path}:2" in summary.rejected_where[0]
    with pytest.raises(DataError, match="longer than seq_len=64") as info:
        tokenize_conversations(convs, tokenizer, seq_len=64, overlong="error")
    assert info.value.line == 2 and info.value.field == "messages"
    # A row whose prompt alone fills seq_len has nothing left to learn after truncation.
    prompt_only = load_jsonl(write_rows(tmp_path / "p.jsonl", [{"prompt": "word " * 300, "response": "ok"}]))
    kept, summary = tokenize_conversations(prompt_only, tokenizer, seq_len=32, overlong="truncate")
    assert kept == [] and summary.rejected == 1 and "no assistant tokens" in summary.rejected_where[0]
    with pytest.raises(ValueError, match="overlong"):
        tokenize_conversations(convs, tokenizer, seq_len=64, overlong="drop")


def test_packing_restarts_positions_and_never_labels_across_samples(tmp_path, tokenizer):
    convs = load_jsonl(write_rows(tmp_path / "mix.jsonl", GOOD * 5))
    examples, _ = tokenize_conversations(convs, tokenizer, seq_len=128)
    blocks = pack_examples(examples, 128)
    assert sum(b.n_samples for b in blocks) == len(examples)
    assert sum(len(b.input_ids) for b in blocks) == sum(len(e.input_ids) for e in examples)
    assert all(len(b.input_ids) <= 128 for b in blocks) and len(blocks) < len(examples)
    for b in blocks:
        starts = [i for i, p in enumerate(b.position_ids) if p == 0]
        assert len(starts) == b.n_samples
        assert all(b.labels[s] == IGNORE_INDEX for s in starts)
    batch = collate(blocks[:2], pad_id=0, packed=True, pad_to=128)
    assert batch["input_ids"].shape == (2, 128) and "attention_mask" not in batch
    assert batch["n_real_tokens"] == len(blocks[0].input_ids) + len(blocks[1].input_ids)


def test_packed_attention_does_not_leak_between_samples(tmp_path, tokenizer, tiny_model):
    """The same sample alone and packed behind another gives the same logits."""
    import torch

    convs = load_jsonl(write_rows(tmp_path / "mix.jsonl", GOOD))
    examples, _ = tokenize_conversations(convs, tokenizer, seq_len=256)
    a, b = examples[0], examples[2]
    alone = collate(pack_examples([b], 256), tokenizer.pad_token_id, packed=True)
    both = pack_examples([a, b], 512)
    assert len(both) == 1
    packed = collate(both, tokenizer.pad_token_id, packed=True)
    with torch.no_grad():
        out_alone = tiny_model(input_ids=alone["input_ids"], position_ids=alone["position_ids"],
                               use_cache=False).logits[0]
        out_packed = tiny_model(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                                use_cache=False).logits[0]
    start = both[0].position_ids.index(0, 1)  # members keep their file order: a first, then b
    n = len(b.input_ids)
    assert torch.allclose(out_packed[start:start + n], out_alone[:n], atol=1e-4)


def full_logits_loss_sum(logits, labels):
    """The textbook loss over every position's logits: the oracle for CausalLMWithLoss."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def test_padded_mode_matches_packed_loss(tokenizer, tmp_path, tiny_model):
    import torch

    from distlab.lm_loss import CausalLMWithLoss

    path = write_rows(tmp_path / "mix.jsonl", GOOD * 2)
    packed = build_sft_data(path, tokenizer, 256, packing=True)
    padded = build_sft_data(path, tokenizer, 256, packing=False)

    def mean_loss(data):
        total = tokens = 0.0
        for i in range(len(data)):
            batch = data.batch([i])
            inputs = {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask") if k in batch}
            with torch.no_grad():
                oracle = full_logits_loss_sum(tiny_model(**inputs, use_cache=False).logits, batch["labels"])
                selected = CausalLMWithLoss(tiny_model)(labels=batch["labels"], **inputs)
            assert float(selected) == pytest.approx(float(oracle), rel=1e-5)  # head only at label positions
            total += float(oracle)
            tokens += batch["n_label_tokens"]
        return total / tokens

    assert len(packed) < len(padded)
    assert abs(mean_loss(packed) - mean_loss(padded)) < 1e-4


def test_repo_dataset_is_valid_and_large_enough():
    from distlab.paths import DEMO_PROMPTS, EVAL_FILE, TRAIN_FILE

    train, held_out = load_jsonl(TRAIN_FILE), load_jsonl(EVAL_FILE)
    assert len(train) >= 600 and len(held_out) >= 50
    assert len(train.summaries[0].by_format) == 3
    def first_question(c):
        return next(m["content"] for m in c.messages if m["role"] == "user")

    train_prompts = {first_question(c) for c in train}
    assert not any(first_question(c) in train_prompts for c in held_out)
    assert len(load_prompts(DEMO_PROMPTS)) >= 5
