"""The data contract: JSONL rows in three formats -> chat messages -> token ids with masked labels.

Accepted rows (a file may mix them; `id`, `category`, `source`, `meta`, `facts` may ride along; `facts`,
when there, is a list of non-empty strings, distlab.keyfacts):
  {"prompt": ..., "response": ...}
  {"question": ..., "answer": ...}
  {"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}

Every row becomes a list of chat messages, rendered with the tokenizer's chat template. The loss
is taken only on assistant tokens (everything else is -100), or with labels="all" on every token, prompts
and template markup included, as in pretraining (the MFU ladder's pretraining-shaped row). Bad input raises
DataError naming the file, the line and the field; nothing is dropped without being counted in the summary.
Prompt files (generation, pipeline inference, key-fact scores) are read by `load_prompts` alone.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from distlab import keyfacts
from distlab.attention import document_starts

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")
FORMATS = {
    "prompt/response": ("prompt", "response"),
    "question/answer": ("question", "answer"),
    "messages": ("messages",),
}
METADATA_KEYS = frozenset({"id", "category", "source", "meta", "facts"})  # facts: distlab.keyfacts
OVERLONG_POLICIES = ("truncate", "reject", "error")
LABEL_POLICIES = ("replies", "all")  # which tokens the loss is taken on: the assistant's, or every one
MAX_ERRORS_SHOWN = 20


class DataError(ValueError):
    """A bad row or file. `path`, `line` (1-based, 0 for the whole file) and `field` say where."""

    def __init__(self, path: str | Path, line: int, field: str, message: str, others: Sequence["DataError"] = ()):
        self.path, self.line, self.field, self.reason = str(path), line, field, message
        self.others = list(others)
        text = f"{path}:{line}: field '{field}': {message}"
        if self.others:
            shown = self.others[:MAX_ERRORS_SHOWN]
            text += f"\n({len(self.others)} more error(s) in this file)\n" + "\n".join(
                f"{e.path}:{e.line}: field '{e.field}': {e.reason}" for e in shown)
            if len(self.others) > len(shown):
                text += f"\n... and {len(self.others) - len(shown)} more"
        super().__init__(text)


@dataclass
class Conversation:
    messages: list[dict[str, str]]
    path: str
    line: int
    format: str
    id: str | None = None
    facts: list[str] = field(default_factory=list)  # the key facts an answer must state (distlab.keyfacts)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class LoadSummary:
    """What a load (and later a tokenisation) did with every row of a file."""

    path: str
    rows: int = 0
    blank_lines: int = 0
    by_format: Counter = field(default_factory=Counter)
    truncated: int = 0
    rejected: int = 0
    rejected_where: list[str] = field(default_factory=list)
    kept: int = 0

    def __str__(self) -> str:
        fmts = ", ".join(f"{k}: {v}" for k, v in sorted(self.by_format.items()))
        text = f"{self.path}: {self.rows} rows read ({fmts})"
        if self.blank_lines:
            text += f", {self.blank_lines} blank lines skipped"
        if self.kept or self.truncated or self.rejected:
            text += f"; {self.kept} kept, {self.truncated} truncated, {self.rejected} rejected"
        return text


class ConversationList(list):
    """A list of Conversation that also carries the LoadSummary of the file(s) it came from."""

    summaries: list[LoadSummary]


def _require_text(obj: dict, key: str, where: tuple[str, int], field_name: str | None = None) -> str:
    name = field_name or key
    if key not in obj:
        raise DataError(*where, name, "missing")
    value = obj[key]
    if not isinstance(value, str):
        raise DataError(*where, name, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(*where, name, "is empty")
    return value


def detect_format(row: dict, where: tuple[str, int]) -> str:
    keys = set(row) - METADATA_KEYS
    matches = [name for name, fk in FORMATS.items() if keys & set(fk)]
    if len(matches) != 1:
        found = ", ".join(sorted(row)) or "no fields"
        why = "mixes the fields of several formats" if matches else "matches no known format"
        raise DataError(*where, "<row>", f"unknown format: {why} (fields: {found}); expected "
                        "prompt+response, question+answer, or messages")
    fmt = matches[0]
    unknown = keys - set(FORMATS[fmt])
    if unknown:
        raise DataError(*where, sorted(unknown)[0], f"unknown field for the {fmt} format "
                        f"(allowed besides {', '.join(FORMATS[fmt])}: {', '.join(sorted(METADATA_KEYS))})")
    return fmt


def normalise_row(row: Any, where: tuple[str, int], require_assistant: bool = True) -> tuple[str, list[dict]]:
    """One parsed JSON value -> (format, chat messages). Raises DataError on anything off."""
    if not isinstance(row, dict):
        raise DataError(*where, "<row>", f"must be a JSON object, got {type(row).__name__}")
    fmt = detect_format(row, where)
    if fmt != "messages":
        user_key, reply_key = FORMATS[fmt]
        messages = [{"role": "user", "content": _require_text(row, user_key, where)}]
        if require_assistant or reply_key in row:
            messages.append({"role": "assistant", "content": _require_text(row, reply_key, where)})
        return fmt, messages

    raw = row["messages"]
    if not isinstance(raw, list):
        raise DataError(*where, "messages", f"must be a list, got {type(raw).__name__}")
    if not raw:
        raise DataError(*where, "messages", "is empty")
    messages = []
    for i, msg in enumerate(raw):
        name = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise DataError(*where, name, f"must be an object, got {type(msg).__name__}")
        extra = set(msg) - {"role", "content"}
        if extra:
            raise DataError(*where, f"{name}.{sorted(extra)[0]}", "unknown field (allowed: role, content)")
        role = _require_text(msg, "role", where, f"{name}.role")
        if role not in ROLES:
            raise DataError(*where, f"{name}.role", f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
        if role == "system" and i != 0:
            raise DataError(*where, f"{name}.role", "a system message may only come first")
        content = _require_text(msg, "content", where, f"{name}.content")
        messages.append({"role": role, "content": content})
    roles = [m["role"] for m in messages]
    if "user" not in roles:
        raise DataError(*where, "messages", "no user turn")
    if require_assistant and "assistant" not in roles:
        raise DataError(*where, "messages", "no assistant turn")
    return fmt, messages


def _row_facts(row: dict, where: tuple[str, int]) -> list[str]:
    """The row's key facts ([] without any); a malformed `facts` is a DataError naming the row."""
    try:
        return keyfacts.facts_of(row)
    except ValueError as e:
        raise DataError(*where, "facts", str(e)) from None


def load_jsonl(path: str | Path, require_assistant: bool = True) -> ConversationList:
    """Read and validate a JSONL file. Every bad row is reported (first one in the message head);
    a file with any bad row raises DataError, so a broken file never trains half-read."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(path, 0, "<file>", f"cannot read: {e.strerror or e}") from e
    summary = LoadSummary(str(path))
    out = ConversationList()
    errors: list[DataError] = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        where = (str(path), lineno)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            errors.append(DataError(*where, "<row>",
                                    f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"))
            continue
        if not text.strip():
            if lineno < data.count(b"\n") + 1 or text:  # the final newline's empty tail is not a blank line
                summary.blank_lines += 1
            continue
        summary.rows += 1
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            errors.append(DataError(*where, "<row>", f"invalid JSON: {e.msg} at column {e.colno}"))
            continue
        try:
            fmt, messages = normalise_row(row, where, require_assistant)
            facts = _row_facts(row, where)
        except DataError as e:
            errors.append(e)
            continue
        summary.by_format[fmt] += 1
        row_id = row.get("id") if isinstance(row.get("id"), str) else None
        out.append(Conversation(messages, str(path), lineno, fmt, row_id, facts))
    if errors:
        raise DataError(errors[0].path, errors[0].line, errors[0].field, errors[0].reason, errors[1:])
    if not out:
        raise DataError(path, 0, "<file>", "empty file: no rows")
    out.summaries = [summary]
    return out


def load_prompts(path: str | Path) -> ConversationList:
    """The one reader of prompt files (generation, before/after inference, pipeline inference, key-fact
    scores): the same formats and checks as load_jsonl, the assistant reply optional (a reference answer).
    Every prompt has an id: its row's, else `prompt-<i>` (i counts the file's rows from 0); answers are
    matched to prompts by id, so an id given twice is a DataError naming both lines."""
    prompts = load_jsonl(path, require_assistant=False)
    first_line: dict[str, int] = {}
    errors = []
    for i, conv in enumerate(prompts):
        conv.id = conv.id or f"prompt-{i}"
        if conv.id in first_line:
            errors.append(DataError(conv.path, conv.line, "id", f"prompt id {conv.id!r} appears more than once "
                                    f"(first on line {first_line[conv.id]}); ids must be unique"))
        first_line.setdefault(conv.id, conv.line)
    if errors:
        raise DataError(errors[0].path, errors[0].line, errors[0].field, errors[0].reason, errors[1:])
    return prompts


# --------------------------------------------------------------------------- tokenisation

@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    where: str


def _assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans the model must learn to produce.

    A span runs from the end of the rendered prefix "... <assistant header>" to the end of the
    rendered conversation up to and including that reply, so it covers the end-of-turn marker
    too: a model that never sees it labelled never learns to stop."""
    def render(msgs, gen=False):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = render(messages[:i], gen=True)
        upto = render(messages[: i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ValueError("the chat template does not render conversations prefix-consistently; "
                             "use a template that does (distlab's default and Qwen2.5's do)")
        spans.append((len(before), len(upto)))
    return full, spans


def encode_conversation(tokenizer, conv: Conversation, labels: str = "replies") -> Example:
    """Token ids and their labels: the assistant's tokens (`labels="replies"`), or every token ("all"; the
    first is never a target: nothing precedes it)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template")
    text, spans = _assistant_char_spans(tokenizer, conv.messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if labels == "all":
        return Example(ids, [IGNORE_INDEX] + ids[1:], conv.where)
    targets = []
    for tok, (start, _end) in zip(ids, enc["offset_mapping"]):
        inside = any(s <= start < e for s, e in spans)
        targets.append(tok if inside else IGNORE_INDEX)
    return Example(ids, targets, conv.where)


def explain_example(tokenizer, conv: Conversation, learned: str = "\u2588") -> str:
    """The rendered row with every token the loss is taken on wrapped in markers, for reading."""
    ex = encode_conversation(tokenizer, conv)
    out, inside = [], False
    for tok, lab in zip(ex.input_ids, ex.labels):
        if (lab != IGNORE_INDEX) != inside:
            out.append(learned)
            inside = not inside
        out.append(tokenizer.decode([tok]))
    return "".join(out) + (learned if inside else "")


def tokenize_conversations(convs: Iterable[Conversation], tokenizer, seq_len: int, overlong: str = "truncate",
                           labels: str = "replies") -> tuple[list[Example], LoadSummary]:
    """Encode (`labels`: encode_conversation), then apply the explicit policy to rows longer than seq_len (and
    count them)."""
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong={overlong!r}: expected one of {', '.join(OVERLONG_POLICIES)}")
    if labels not in LABEL_POLICIES:
        raise ValueError(f"labels={labels!r}: expected one of {', '.join(LABEL_POLICIES)}")
    convs = list(convs)
    summary = LoadSummary(", ".join(sorted({c.path for c in convs})))
    summary.rows = len(convs)
    summary.by_format = Counter(c.format for c in convs)
    examples = []
    for conv in convs:
        ex = encode_conversation(tokenizer, conv, labels)
        if len(ex.input_ids) > seq_len:
            if overlong == "error":
                raise DataError(conv.path, conv.line, "messages",
                                f"row is {len(ex.input_ids)} tokens, longer than seq_len={seq_len}")
            if overlong == "reject":
                summary.rejected += 1
                summary.rejected_where.append(f"{conv.where} ({len(ex.input_ids)} tokens)")
                continue
            ex = Example(ex.input_ids[:seq_len], ex.labels[:seq_len], ex.where)
            if all(label == IGNORE_INDEX for label in ex.labels):
                # Truncation cut away every assistant token: nothing left to learn from.
                summary.rejected += 1
                summary.rejected_where.append(f"{conv.where} (no assistant tokens within seq_len={seq_len})")
                continue
            summary.truncated += 1
        examples.append(ex)
    summary.kept = len(examples)
    return examples, summary


# --------------------------------------------------------------------------- batching

@dataclass
class Item:
    """One row of a batch: a packed block of several examples, or one (padded later) example."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]
    n_samples: int


def pack_examples(examples: Sequence[Example], seq_len: int) -> list[Item]:
    """First-fit-decreasing packing into blocks of at most seq_len tokens.

    Position ids restart at 0 for every example; the model (transformers >= 4.54 with sdpa/eager,
    flash-attention too) turns that into a block-diagonal causal mask, so packed examples never
    attend to each other. The first token of every example is a prompt token, so no label
    crosses a boundary either. Deterministic: ties are broken by original order."""
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i].input_ids), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = len(examples[i].input_ids)
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(seq_len - n)
    items = []
    for members in bins:
        members.sort()
        ids, labels, pos = [], [], []
        for i in members:
            ex = examples[i]
            ids += ex.input_ids
            labels += [IGNORE_INDEX] + ex.labels[1:]
            pos += list(range(len(ex.input_ids)))
        items.append(Item(ids, labels, pos, len(members)))
    return items


def single_examples(examples: Sequence[Example]) -> list[Item]:
    return [Item(ex.input_ids, ex.labels, list(range(len(ex.input_ids))), 1) for ex in examples]


def collate(items: Sequence[Item], pad_id: int, packed: bool, pad_to: int | None = None) -> dict[str, Any]:
    """Right-pad to the longest row (or `pad_to`). Packed batches carry position_ids and no
    attention mask (the mask comes from the position ids); padded batches carry an attention
    mask. Counts of real tokens, label tokens and samples travel with the batch for logging."""
    width = max(pad_to or 0, max(len(it.input_ids) for it in items))
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros((len(items), width), dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for r, it in enumerate(items):
        n = len(it.input_ids)
        ids[r, :n] = torch.tensor(it.input_ids)
        labels[r, :n] = torch.tensor(it.labels)
        pos[r, :n] = torch.tensor(it.position_ids)
        # Padding gets its own restarting positions so it forms a separate "sequence" when packed.
        pos[r, n:] = torch.arange(width - n)
        mask[r, :n] = 1
    batch: dict[str, Any] = {"input_ids": ids, "labels": labels}
    if packed:
        batch["position_ids"] = pos
        batch.update(document_bounds(pos))
    else:
        batch["attention_mask"] = mask
    batch.update(label_positions(labels))
    batch["n_real_tokens"] = int(mask.sum())
    batch["n_label_tokens"] = len(batch["label_targets"])
    batch["n_samples"] = sum(it.n_samples for it in items)
    return batch


def document_bounds(position_ids: torch.Tensor) -> dict[str, Any]:
    """Where each packed document starts, for per-document attention (distlab.attention), built here on the
    host where the rows are, so no step reads them back from a device: `cu_seq_lens_q` holds every start
    with the rows laid end to end, then rows x width (int32, flash-attention's convention); `max_length_q`
    is the row width, a bound that is the same for every batch (a compiled block never sees a new one).
    Where documents start: distlab.attention.document_starts."""
    rows, width = position_ids.shape
    flat = torch.cat([document_starts(position_ids).flatten().nonzero().flatten(), torch.tensor([rows * width])])
    return {"cu_seq_lens_q": flat.to(torch.int32), "max_length_q": width}


def label_positions(labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The positions whose next token is a label, as flat indices into (rows x width) hidden states, and
    those labels: the loss gathers exactly these rows without a boolean mask, which would read its count
    back from the device (distlab.lm_loss)."""
    following = torch.full_like(labels, IGNORE_INDEX)
    following[:, :-1] = labels[:, 1:]
    flat = following.flatten()
    where = (flat != IGNORE_INDEX).nonzero().flatten()
    return {"label_index": where, "label_targets": flat[where]}


MODEL_INPUTS = ("input_ids", "labels", "position_ids", "attention_mask", "cu_seq_lens_q", "max_length_q",
                "label_index", "label_targets")


def model_inputs(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """What a model's forward takes of a batch, tensors moved to `device` (the bound stays a Python int)."""
    return {k: batch[k].to(device, non_blocking=True) if isinstance(batch[k], torch.Tensor) else batch[k]
            for k in MODEL_INPUTS if k in batch}


@dataclass
class SFTData:
    """Tokenised training items plus how they were built; the one input every strategy uses."""

    items: list[Item]
    packed: bool
    seq_len: int
    pad_id: int
    summary: LoadSummary

    def __len__(self) -> int:
        return len(self.items)

    def batch(self, indices: Sequence[int]) -> dict[str, Any]:
        return collate([self.items[i] for i in indices], self.pad_id, self.packed,
                       pad_to=self.seq_len if self.packed else None)

    @property
    def real_tokens(self) -> int:
        return sum(len(it.input_ids) for it in self.items)

    @property
    def label_tokens(self) -> int:
        """Tokens the loss is taken on (labels are shifted in the loss: a row's first label never counts)."""
        return sum(sum(1 for label in it.labels[1:] if label != IGNORE_INDEX) for it in self.items)

    @property
    def document_lengths(self) -> list[int]:
        """The length of every example: a packed block holds several, whose position ids restart at 0."""
        lengths = []
        for it in self.items:
            starts = [i for i, p in enumerate(it.position_ids) if p == 0] + [len(it.position_ids)]
            lengths += [b - a for a, b in zip(starts, starts[1:])]
        return lengths

    @property
    def fill(self) -> float:
        """Fraction of a packed block that carries real tokens (1.0 = no padding at all)."""
        if not self.packed:
            return math.nan
        return self.real_tokens / (len(self.items) * self.seq_len)


def build_sft_data(paths: str | Path | Sequence[str | Path], tokenizer, seq_len: int,
                   packing: bool = True, overlong: str = "truncate", labels: str = "replies") -> SFTData:
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    convs: list[Conversation] = []
    for p in paths:
        convs.extend(load_jsonl(p))
    examples, summary = tokenize_conversations(convs, tokenizer, seq_len, overlong, labels)
    items = pack_examples(examples, seq_len) if packing else single_examples(examples)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return SFTData(items, packing, seq_len, pad_id, summary)
