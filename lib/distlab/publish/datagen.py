"""Deterministic generator of the Acme Corp IT/HR helpdesk fine-tuning dataset.

    python -m distlab.publish.datagen          # (re)write data/support/, data/prompts/, data/README.md
    python -m distlab.publish.datagen --check  # exit 1 and name the files that differ from the output
    python -m distlab.publish.datagen --stats  # print row counts and length statistics

The data is built from tables: topics -> intents -> (user phrasings with entity slots, one answer
template). An answer depends only on (intent, entity values), never on the phrasing, so a small
model can learn the mapping and be measured on rows it has not seen. The eval split holds out
one phrasing per intent and a few entity values everywhere, so every eval prompt is new text
while every eval intent is also trained on.

The tables are YAML files in data/generator/ (its README.md walks through them):
    topics/<category>.yaml   one topic: its escalation reply and its intents
    entities.yaml            the values of every {slot}, and the held-out ones
    rules.yaml               policy text derived from numeric slots by threshold ({receipt_rule} ...)
    shared.yaml              topic order, system prompts, follow-up questions, demo intents
    README.template.md       the text of data/README.md
This module is the logic: loading and validating the tables, the split, the sampling, the row formats.

To add an intent, append `{name, phrasings, answer}` to the `intents` of its topic file (a new
topic is a new file plus a line in shared.yaml). All phrasings of an intent use the same slots;
a new slot needs its values and held-out values in entities.yaml. Then run the generator: it
validates the tables (an error names the file, the intent and the field) and rewrites data/.
Commit both; tests/unit/test_datagen.py fails when the committed data and the tables drift apart.
A new intent changes every intent's row quota, so most rows change; that is expected.

Only seeded `random.Random` instances are used, seeded from strings (which hash with SHA-512,
not Python's randomized hash).
"""

from __future__ import annotations

import argparse
import itertools
import random
import re
import statistics
import string
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, NamedTuple

import yaml

from distlab import yaml_input
from distlab.cli import run_main
from distlab.jsonio import strict_json
from distlab.paths import DATA_DIR, REPO_ROOT

SEED = 1234
TABLES_DIR = DATA_DIR / "generator"
FILES = {
    "train": "data/support/train.jsonl",
    "eval": "data/support/eval.jsonl",
    "prompts": "data/prompts/demo_prompts.jsonl",
    "readme": "data/README.md",
    "pretrain": "data/pretrain/corpus.jsonl",
}
PRETRAIN_ROWS_PER_INTENT = 64  # of the other company's rows, sampled from all phrasings and values
PRETRAIN_GENERAL_REPEATS = 4  # each general entry, in every phrasing, with and without a system prompt

TRAIN_ROWS = 720
EVAL_ROWS = 120
SYSTEM_SHARE = 0.85  # of messages rows; the rest teach the model to answer without one
MULTI_TURN_SHARE = 0.10  # of messages rows
# Two messages rows per prompt/response and question/answer row gives the 50/25/25 mix exactly.
FORMAT_CYCLE = ("messages", "prompt", "messages", "question")
# Bounds that keep a whole row inside a 256-token sequence with a ~4k-vocab BPE tokenizer.
MIN_ANSWER_WORDS, MAX_ANSWER_WORDS, MAX_ROW_WORDS = 12, 110, 160
MIN_PHRASINGS = 4  # one is held out for eval; the others still vary the wording in train


# --------------------------------------------------------------------------------------------
# Loading and validating the tables
# --------------------------------------------------------------------------------------------

# The shape of each table file. A dict is a mapping with exactly these fields ("?" marks an optional
# one; "*" stands for any names, each holding the given shape), a one-item list is a list of that
# shape, a type (or a tuple of types) is a non-empty value of that type.
SHAPES = {
    "shared.yaml": {"topics": [str], "system_prompts": [str], "follow_ups": [str], "demo_intents": [str]},
    "entities.yaml": {"*": {"values": [(str, int)], "heldout": [(str, int)]}},
    "rules.yaml": {"*": {"*": [{"above?": int, "text": str}]}},
    "topics/*.yaml": {"escalation": str, "intents": [{"name": str, "phrasings": [str], "answer": str}]},
    "other_company.yaml": {"company": str, "names": {"*": str}, "facts": {"*": str},
                           "thresholds": {"*": {"*": int}}},
    "general.yaml": {"entries": [{"phrasings": [str], "answer": str}], "products?": [str]},
}


class Intent(NamedTuple):
    name: str
    phrasings: tuple[str, ...]  # every phrasing uses the same {slots}
    answer: str  # may also use the fields rules.yaml derives from those slots
    line: int  # where the entry starts in its file, for error messages


class Topic(NamedTuple):
    category: str
    escalation: str  # the assistant's reply to a generic "what if that doesn't work?" follow-up
    intents: tuple[Intent, ...]
    path: Path


class Other(NamedTuple):
    """The other company (other_company.yaml): Acme text -> its text, facts first, and its thresholds."""
    company: str
    facts: dict[str, str]
    names: dict[str, str]
    thresholds: dict[str, dict[int, int]]
    pattern: re.Pattern  # every key, longest first, one alternation
    swapped: dict[tuple[str, bool], tuple[str, tuple[str, ...]]]  # (text, replace) -> (its swap, fact keys met)

    def swap(self, text: str, found: list[str] | None = None, replace: bool = True) -> str:
        """Text with every key replaced (`replace=False`: unchanged); appends the fact keys met to `found`.
        Remembered per text: validation renders every phrasing x value combination, and their answers and rule
        texts are few."""
        if (text, replace) not in self.swapped:
            met: list[str] = []

            def one(match: re.Match) -> str:
                key = match.group(0)
                if key in self.facts and key not in met:
                    met.append(key)
                return (self.facts.get(key) or self.names[key]) if replace else key
            self.swapped[text, replace] = (self.pattern.sub(one, text), tuple(met))
        out, met_keys = self.swapped[text, replace]
        if found is not None:
            found.extend(key for key in met_keys if key not in found)
        return out


class Tables(NamedTuple):
    topics: tuple[Topic, ...]  # in shared.yaml's order, which is also the sampling order
    slot_values: dict[str, tuple]
    heldout: dict[str, tuple]  # values that never occur in train
    rules: dict[str, dict[str, tuple[tuple[int | None, str], ...]]]  # slot -> field -> ((above, text), ...)
    system_prompts: tuple[str, ...]
    follow_ups: tuple[str, ...]
    demo_intents: tuple[str, ...]  # intents whose unused held-out combinations become the demo prompts
    directory: Path
    other: Other  # the other company, for the base model's pretraining corpus and the key facts
    general: tuple[tuple[tuple[str, ...], str], ...]  # (phrasings, answer) of general IT text
    products: frozenset[str] = frozenset()  # Acme fact keys general text may name: product names, not policies


class TableError(ValueError):
    """A malformed table. The message names the file (and line), the entry (topic/intent or slot) and the field."""

    def __init__(self, path: Path, entry: str | None, field: str | None, reason: str, line: int | None = None):
        self.path, self.entry, self.field, self.reason, self.line = Path(path), entry, field, reason, line
        shown = self.path.relative_to(REPO_ROOT) if self.path.is_relative_to(REPO_ROOT) else self.path
        parts = (f"{shown}:{line}" if line else str(shown), entry, field and f"field '{field}'", reason)
        super().__init__(": ".join(p for p in parts if p))


class _Mapping(dict):
    line = 0  # 1-based line where the mapping starts


class _TableLoader(yaml.SafeLoader):
    """Safe YAML that keeps each mapping's line and rejects duplicate keys (PyYAML keeps the last silently)."""


def _construct_mapping(loader: _TableLoader, node: yaml.MappingNode) -> _Mapping:
    mapping = _Mapping()
    mapping.line = node.start_mark.line + 1
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in mapping:
            raise yaml.MarkedYAMLError(problem=f"duplicate key {key!r}", problem_mark=key_node.start_mark)
        mapping[key] = loader.construct_object(value_node, deep=True)
    return mapping


_TableLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _check_shape(value, shape, path: Path, entry: str | None, field: str | None, line: int) -> None:
    """Raise TableError at the first place `value` differs from `shape` (see SHAPES)."""
    line = getattr(value, "line", line)
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            raise TableError(path, entry, field, f"must be a mapping, got {value!r}", line)
        if "*" in shape:
            for key, item in value.items():
                _check_shape(item, shape["*"], path, f"{entry}/{key}" if entry else str(key), None, line)
            return
        fields = {name.rstrip("?"): (sub, name.endswith("?")) for name, sub in shape.items()}
        for name in value:
            if name not in fields:
                raise TableError(path, entry, str(name), f"unknown field (expected {', '.join(fields)})", line)
        for name, (sub, optional) in fields.items():
            if name in value:
                _check_shape(value[name], sub, path, entry, f"{field}.{name}" if field else name, line)
            elif not optional:
                raise TableError(path, entry, name, "missing", line)
    elif isinstance(shape, list):
        if type(value) is not list:
            raise TableError(path, entry, field, f"must be a list, got {value!r}", line)
        for i, item in enumerate(value):
            if isinstance(item, dict) and type(item.get("name")) is str:  # an intent: name it, not its index
                _check_shape(item, shape[0], path, f"{entry}/{item['name']}", None, line)
            else:
                _check_shape(item, shape[0], path, entry if field else f"{entry}[{i}]",
                             f"{field}[{i}]" if field else None, line)
    elif type(value) not in (shape if isinstance(shape, tuple) else (shape,)) or not str(value).strip():
        kinds = " or ".join(t.__name__ for t in (shape if isinstance(shape, tuple) else (shape,)))
        raise TableError(path, entry, field, f"must be a non-empty {kinds}, got {value!r}", line)


def _read(path: Path, shape, entry: str | None = None):
    if not path.is_file():
        raise TableError(path, None, None, "no such file")
    try:
        doc = yaml_input.load_file(path, loader=_TableLoader)
    except yaml_input.YamlInputError as exc:
        raise TableError(path, None, None, exc.reason, exc.line) from None
    _check_shape(doc, shape, path, entry, None, 0)
    return doc


def load_tables(directory: Path = TABLES_DIR) -> Tables:
    """Read and validate the tables in `directory` (data/generator/ by default); raises TableError."""
    directory = Path(directory)
    shared = _read(directory / "shared.yaml", SHAPES["shared.yaml"])
    entities = _read(directory / "entities.yaml", SHAPES["entities.yaml"])
    rules = _read(directory / "rules.yaml", SHAPES["rules.yaml"])
    general = _read(directory / "general.yaml", SHAPES["general.yaml"])
    unlisted = sorted({p.stem for p in (directory / "topics").glob("*.yaml")} - set(shared["topics"]))
    if unlisted:
        raise TableError(directory / "shared.yaml", None, "topics", f"topics/{unlisted[0]}.yaml is not listed")
    topics = []
    for category in shared["topics"]:
        path = directory / "topics" / f"{category}.yaml"
        doc = _read(path, SHAPES["topics/*.yaml"], category)
        intents = tuple(Intent(i["name"], tuple(i["phrasings"]), i["answer"], i.line) for i in doc["intents"])
        topics.append(Topic(category, doc["escalation"], intents, path))
    tables = Tables(
        topics=tuple(topics),
        slot_values={slot: tuple(entry["values"]) for slot, entry in entities.items()},
        heldout={slot: tuple(entry["heldout"]) for slot, entry in entities.items()},
        rules={slot: {field: tuple((case.get("above"), case["text"]) for case in cases)
                      for field, cases in fields.items()} for slot, fields in rules.items()},
        system_prompts=tuple(shared["system_prompts"]),
        follow_ups=tuple(shared["follow_ups"]),
        demo_intents=tuple(shared["demo_intents"]),
        directory=directory,
        other=_load_other(directory / "other_company.yaml"),
        general=tuple((tuple(e["phrasings"]), e["answer"]) for e in general["entries"]),
        products=frozenset(general.get("products", ())))
    _validate_tables(tables)
    return tables


def _load_other(path: Path) -> Other:
    doc = _read(path, SHAPES["other_company.yaml"])
    facts, names = {str(k): v for k, v in doc["facts"].items()}, {str(k): v for k, v in doc["names"].items()}
    both = sorted({**names, **facts}, key=len, reverse=True)
    pattern = re.compile("|".join(re.escape(k) for k in both))
    thresholds = {slot: {int(a): int(b) for a, b in m.items()} for slot, m in doc["thresholds"].items()}
    return Other(doc["company"], facts, names, thresholds, pattern, swapped={})


# --------------------------------------------------------------------------------------------
# Rendering one (intent, phrasing, slot values) into a prompt and an answer
# --------------------------------------------------------------------------------------------

def _fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def _slots(intent: Intent) -> tuple[str, ...]:
    return tuple(sorted(_fields(intent.phrasings[0])))


def _words(*texts: str) -> int:
    return sum(len(t.split()) for t in texts)


def _derived(slot: str, value: int, tables: Tables, other: bool) -> dict[str, tuple[str, list[str]]]:
    """The answer fields rules.yaml computes from one slot value: per field, the text of the first case it is
    above (with `other`, the other company's thresholds and text) and the key facts that text states."""
    fields, moved = {}, tables.other.thresholds.get(slot, {}) if other else {}
    for field, cases in tables.rules.get(slot, {}).items():
        above, text = next((moved.get(above, above), text) for above, text in cases
                           if above is None or value > moved.get(above, above))
        facts: list[str] = []
        text = tables.other.swap(text, facts, replace=other)  # before filling: slot values are never facts
        fields[field] = (text.format(**{slot: value, "excess": value - (above or 0)}), facts)
    return fields


def _render(intent: Intent, phrasing: int, values: tuple, tables: Tables,
            other: bool = False) -> tuple[str, str, tuple[str, ...]]:
    """(prompt, answer, key facts): the facts are the other_company.yaml keys in the answer's template and
    rule texts, which `other=True` replaces with the other company's."""
    context, facts, used = dict(zip(_slots(intent), values)), [], _fields(intent.answer)
    for slot, value in list(context.items()):
        for field, (text, field_facts) in _derived(slot, value, tables, other).items():
            context[field] = text
            facts += [f for f in field_facts if field in used and f not in facts]  # only rule texts it states
    answer = tables.other.swap(intent.answer, facts, replace=other).format(**context)
    return intent.phrasings[phrasing].format(**context), answer, tuple(facts)


def _candidates(intent: Intent, tables: Tables) -> list[tuple[int, tuple]]:
    values = itertools.product(*(tables.slot_values[s] for s in _slots(intent)))
    return [(p, v) for v in values for p in range(len(intent.phrasings))]


# --------------------------------------------------------------------------------------------
# Validating the tables
# --------------------------------------------------------------------------------------------

def _template_fields(template: str, fail: Callable[[str], TableError]) -> set[str]:
    try:
        return _fields(template)
    except ValueError as exc:  # unbalanced braces
        raise fail(f"bad template ({exc}): {template!r}") from exc


def _validate_tables(tables: Tables) -> None:
    """Fail loudly on table mistakes that would silently make the data wrong or unlearnable."""
    shared_path, entities_path = tables.directory / "shared.yaml", tables.directory / "entities.yaml"
    rules_path = tables.directory / "rules.yaml"
    for field in ("topics", "system_prompts", "follow_ups", "demo_intents"):
        if not getattr(tables, field):
            raise TableError(shared_path, None, field, "must not be empty")
    for slot, values in tables.slot_values.items():
        if not values or len(set(values)) < len(values):
            raise TableError(entities_path, slot, "values", "must be a non-empty list without repeats")
        if not set(tables.heldout[slot]) < set(values):
            raise TableError(entities_path, slot, "heldout", "must be some, not all, of the slot's values")
    derived_by: dict[str, str] = {}  # rule field -> its slot
    for slot, fields in tables.rules.items():
        if any(type(v) is not int for v in tables.slot_values.get(slot, ("missing",))):
            raise TableError(rules_path, slot, None, "rules need a slot of entities.yaml with whole-number values")
        for field, cases in fields.items():
            if derived_by.setdefault(field, slot) != slot or field in tables.slot_values:
                raise TableError(rules_path, f"{slot}/{field}", None, "this name already names a slot or a rule")
            thresholds = [above for above, _ in cases]
            if not cases or thresholds[-1] is not None or thresholds[:-1] != sorted(set(thresholds[:-1]))[::-1]:
                raise TableError(rules_path, f"{slot}/{field}", "above", "cases need decreasing thresholds and "
                                 f"a last case without one, got {thresholds}")
            for i, (above, text) in enumerate(cases):
                where, allowed = f"{slot}/{field}[{i}]", {slot, "excess"} if above is not None else {slot}
                names = _template_fields(text, lambda reason: TableError(rules_path, where, "text", reason))
                if names - allowed:
                    raise TableError(rules_path, where, "text", f"unknown field {{{min(names - allowed)}}}: "
                                     f"a case can use {{{slot}}} and, with `above`, {{excess}}")

    longest_system = max(_words(s) for s in tables.system_prompts)
    topic_of: dict[str, str] = {}  # intent name -> topic
    seen: dict[str, tuple] = {}  # rendered prompt -> (intent, values)
    for topic in tables.topics:
        for intent in topic.intents:
            if intent.name in topic_of:
                raise TableError(topic.path, f"{topic.category}/{intent.name}", "name",
                                 f"already used in topic {topic_of[intent.name]}", intent.line)
            topic_of[intent.name] = topic.category
            _validate_intent(topic, intent, tables, longest_system, seen)
    for i, name in enumerate(tables.demo_intents):
        if name not in topic_of:
            raise TableError(shared_path, None, f"demo_intents[{i}]", f"no intent named {name!r}")
    _validate_other(tables)


def _validate_other(tables: Tables) -> None:
    """Before-accuracy is only low if the other company never states an Acme fact, and a fact key that no
    template uses is a typo."""
    path, other = tables.directory / "other_company.yaml", tables.other
    keys = {k.casefold(): k for k in other.facts}
    for key, value in {**other.facts, **other.names}.items():
        clash = next((k for folded, k in keys.items() if folded in value.casefold()), None)
        if clash:
            raise TableError(path, key, "facts", f"the other company's {value!r} states Acme's fact {clash!r}")
    unknown = sorted(tables.products - set(other.facts))
    if unknown:
        raise TableError(tables.directory / "general.yaml", None, "products", f"{unknown[0]!r} is not an Acme fact key")
    # General text may name a product (a word any base model knows) but state no other Acme fact.
    policy = {folded: k for folded, k in keys.items() if k not in tables.products}
    for phrasings, answer in tables.general:
        clash = next((k for folded, k in policy.items() if folded in answer.casefold()), None)
        if clash:
            raise TableError(tables.directory / "general.yaml", phrasings[0], "answer", f"states Acme's fact {clash!r}")
    used: list[str] = []
    texts = [i.answer for t in tables.topics for i in t.intents] + [t.escalation for t in tables.topics]
    texts += [text for fields in tables.rules.values() for cases in fields.values() for _, text in cases]
    for text in texts:
        other.swap(text, used)
    unused = sorted(set(other.facts) - set(used))
    if unused:
        raise TableError(path, unused[0], "facts", "no answer, escalation or rule text contains this key")
    for slot, moved in other.thresholds.items():
        known = {above for cases in tables.rules.get(slot, {}).values() for above, _ in cases if above is not None}
        if not set(moved) <= known:
            raise TableError(path, slot, "thresholds", f"{sorted(set(moved) - known)} are not thresholds of "
                                                       f"rules.yaml's {slot} (those are {sorted(known)})")


def _validate_intent(topic: Topic, intent: Intent, tables: Tables, longest_system: int, seen: dict) -> None:
    def fail(field: str, reason: str) -> TableError:
        return TableError(topic.path, f"{topic.category}/{intent.name}", field, reason, intent.line)

    if len(intent.phrasings) < MIN_PHRASINGS:
        raise fail("phrasings", f"has {len(intent.phrasings)}, needs at least {MIN_PHRASINGS}")
    slots = None
    for i, phrasing in enumerate(intent.phrasings):
        field = f"phrasings[{i}]"
        names = _template_fields(phrasing, lambda reason: fail(field, reason))
        unknown = sorted(names - set(tables.slot_values))
        if unknown:
            raise fail(field, f"unknown slot {{{unknown[0]}}}: not in entities.yaml")
        if slots is None:
            slots = names
        elif names != slots:  # a phrasing that drops a slot would hide answer content
            raise fail(field, f"uses slots {sorted(names)}, but phrasings[0] uses {sorted(slots)}")
    derived = {field for slot in slots for field in tables.rules.get(slot, {})}
    unknown = sorted(_template_fields(intent.answer, lambda reason: fail("answer", reason)) - slots - derived)
    if unknown:
        raise fail("answer", f"unknown slot {{{unknown[0]}}}: the phrasings' slots are {sorted(slots)} and the "
                             f"fields rules.yaml derives from them {sorted(derived)}")
    for phrasing, values in _candidates(intent, tables):
        prompt, answer, _ = _render(intent, phrasing, values, tables)
        if seen.setdefault(prompt, (intent.name, values)) != (intent.name, values):
            raise fail(f"phrasings[{phrasing}]", f"renders {prompt!r}, as intent {seen[prompt][0]} does "
                                                 "with another answer")
        if not MIN_ANSWER_WORDS <= _words(answer) <= MAX_ANSWER_WORDS:
            raise fail("answer", f"has {_words(answer)} words with {values}, needs {MIN_ANSWER_WORDS} to "
                                 f"{MAX_ANSWER_WORDS}: {answer!r}")
        if longest_system + _words(prompt, answer) > MAX_ROW_WORDS:
            raise fail("answer", f"with {values} and the longest system prompt a row exceeds {MAX_ROW_WORDS} words")


# --------------------------------------------------------------------------------------------
# Sampling the splits and writing rows
# --------------------------------------------------------------------------------------------

class Example(NamedTuple):
    category: str
    intent: str
    prompt: str
    answer: str
    facts: tuple[str, ...]
    escalation: str


def _rng(seed: int, *parts: str) -> random.Random:
    # String seeds go through SHA-512, so streams are independent of PYTHONHASHSEED, and each
    # (purpose, intent) gets its own stream: editing one intent does not reshuffle the others.
    return random.Random(":".join(map(str, (seed, *parts))))


def _split_pools(intent: Intent, seed: int, tables: Tables) -> tuple[list, list]:
    """(train-eligible, held-out) candidates: a candidate is held out if its phrasing or any of
    its entity values is held out, so no held-out combination can also occur in train."""
    held_phrasing = _rng(seed, "held-phrasing", intent.name).randrange(len(intent.phrasings))
    slots = _slots(intent)
    train, heldout = [], []
    for phrasing, values in _candidates(intent, tables):
        novel = phrasing == held_phrasing or any(v in tables.heldout[s] for s, v in zip(slots, values))
        (heldout if novel else train).append((phrasing, values))
    return train, heldout


def _quotas(total: int, n: int) -> list[int]:
    return [total // n + (i < total % n) for i in range(n)]


def _make(topic: Topic, intent: Intent, candidates: list, tables: Tables) -> list[Example]:
    return [Example(topic.category, intent.name, *_render(intent, p, v, tables), topic.escalation)
            for p, v in candidates]


def _examples(seed: int, tables: Tables) -> tuple[dict[str, list[Example]], list[Example]]:
    """Per-intent sampling: train rows from the train pool, eval rows and demos from the
    held-out pool, in table order."""
    intents = [(t, i) for t in tables.topics for i in t.intents]
    train_q, eval_q = _quotas(TRAIN_ROWS, len(intents)), _quotas(EVAL_ROWS, len(intents))
    splits: dict[str, list[Example]] = {"train": [], "eval": []}
    unused: dict[str, list[Example]] = {}
    for (topic, intent), n_train, n_eval in zip(intents, train_q, eval_q):
        train_pool, heldout_pool = _split_pools(intent, seed, tables)
        if len(train_pool) < n_train or len(heldout_pool) <= n_eval:
            raise TableError(topic.path, f"{topic.category}/{intent.name}", "phrasings",
                             f"{len(train_pool)} train and {len(heldout_pool)} held-out combinations are too few for "
                             f"{n_train} train rows, {n_eval} eval rows and a demo", intent.line)
        rng = _rng(seed, "sample", intent.name)
        picked_train = rng.sample(train_pool, n_train)
        heldout = rng.sample(heldout_pool, len(heldout_pool))
        splits["train"] += _make(topic, intent, picked_train, tables)
        splits["eval"] += _make(topic, intent, heldout[:n_eval], tables)
        unused[intent.name] = _make(topic, intent, heldout[n_eval:], tables)
    # Demos are shown to readers, so prefer a full question over a terse fragment.
    demos = []
    for name in tables.demo_intents:
        pool = unused[name]
        demos.append(next((e for e in pool if e.prompt.endswith("?")), pool[0]))
    return splits, demos


def _row(row_id: str, ex: Example, fmt: str, rng: random.Random, tables: Tables) -> dict:
    row = {"id": row_id, "category": ex.category}
    if fmt == "prompt":
        return {**row, "prompt": ex.prompt, "response": ex.answer}
    if fmt == "question":
        return {**row, "question": ex.prompt, "answer": ex.answer}
    return {**row, "messages": _messages(ex, rng, tables.system_prompts, tables.follow_ups)}


def _messages(ex: Example, rng: random.Random, system_prompts, follow_ups) -> list[dict]:
    messages = []
    if rng.random() < SYSTEM_SHARE:
        messages.append({"role": "system", "content": rng.choice(system_prompts)})
    messages += [{"role": "user", "content": ex.prompt},
                 {"role": "assistant", "content": ex.answer}]
    if rng.random() < MULTI_TURN_SHARE:
        follow_up = [{"role": "user", "content": rng.choice(follow_ups)},
                     {"role": "assistant", "content": ex.escalation}]
        if _words(*(m["content"] for m in messages + follow_up)) <= MAX_ROW_WORDS:
            messages += follow_up
    return messages


def pretrain_rows(seed: int, tables: Tables) -> list[dict]:
    """The default base model's pretraining corpus: the other company's helpdesk (every phrasing and
    value may occur: the base knows the domain, not Acme) plus general IT text, all as chat rows."""
    other = tables.other
    system_prompts = [other.swap(s) for s in tables.system_prompts]
    rows = []
    for topic in tables.topics:
        escalation = other.swap(topic.escalation)
        for intent in topic.intents:
            rng = _rng(seed, "pretrain", intent.name)
            pool = _candidates(intent, tables)
            for p, v in rng.sample(pool, min(PRETRAIN_ROWS_PER_INTENT, len(pool))):
                ex = Example(topic.category, intent.name, *_render(intent, p, v, tables, other=True), escalation)
                rows.append({"category": topic.category,
                             "messages": _messages(ex, rng, system_prompts, tables.follow_ups)})
    rng = _rng(seed, "pretrain", "general")
    for _ in range(PRETRAIN_GENERAL_REPEATS):
        for phrasings, answer in tables.general:
            for phrasing in phrasings:
                system = [{"role": "system", "content": rng.choice(system_prompts)}] if rng.random() < 0.5 else []
                rows.append({"category": "general", "messages": system + [
                    {"role": "user", "content": phrasing}, {"role": "assistant", "content": answer}]})
    _rng(seed, "pretrain", "order").shuffle(rows)
    return [{"id": f"pretrain-{i:05d}", **row} for i, row in enumerate(rows)]


def first_user_text(row: dict) -> str:
    """The user's (first) request in any of the three row formats."""
    if "messages" in row:
        return next(m["content"] for m in row["messages"] if m["role"] == "user")
    return row.get("prompt", row.get("question"))


def row_words(row: dict) -> int:
    if "messages" in row:
        return _words(*(m["content"] for m in row["messages"]))
    return _words(*(v for k, v in row.items() if k not in ("id", "category", "facts")))


def row_format(row: dict) -> str:
    return next(k for k in ("messages", "prompt", "question") if k in row)


def generate(seed: int = SEED, tables: Tables | None = None) -> dict[str, list[dict]]:
    """All rows: {"train": [...], "eval": [...], "prompts": [{"id", "prompt"}, ...]}, from the tables in
    data/generator/ unless others are given (see `load_tables`)."""
    tables = tables if tables is not None else load_tables()
    splits, demos = _examples(seed, tables)
    out: dict[str, list[dict]] = {}
    for split, examples in splits.items():
        # Shuffle so topics interleave in training order; formats are then dealt round-robin.
        _rng(seed, "order", split).shuffle(examples)
        rng = _rng(seed, "format", split)
        out[split] = [_row(f"{split}-{i:04d}", ex, FORMAT_CYCLE[i % len(FORMAT_CYCLE)], rng, tables)
                      for i, ex in enumerate(examples)]
        if split == "eval":  # what key-fact accuracy checks (distlab.keyfacts)
            out[split] = [{**row, "facts": list(ex.facts)} for row, ex in zip(out[split], examples)]
    out["prompts"] = [{"id": f"demo-{i:02d}-{ex.category}", "prompt": ex.prompt, "facts": list(ex.facts)}
                      for i, ex in enumerate(demos, 1)]
    out["pretrain"] = pretrain_rows(seed, tables)

    train_prompts = {first_user_text(r) for r in out["train"]}
    eval_prompts = {first_user_text(r) for r in out["eval"]}
    assert not train_prompts & eval_prompts, "eval prompt leaked into train"
    assert not {p["prompt"] for p in out["prompts"]} & (train_prompts | eval_prompts)
    assert {r["category"] for r in out["eval"]} <= {r["category"] for r in out["train"]}
    assert all(r["facts"] for r in out["eval"]), "an eval row without key facts"
    ids = [r["id"] for rows in out.values() for r in rows]
    assert len(ids) == len(set(ids))
    assert all(row_words(r) <= MAX_ROW_WORDS for s in ("train", "eval") for r in out[s])
    return out


# --------------------------------------------------------------------------------------------
# Statistics, README and files
# --------------------------------------------------------------------------------------------

def summarize(data: dict[str, list[dict]]) -> dict:
    stats = {}
    for split in ("train", "eval"):
        rows = data[split]
        words = [row_words(r) for r in rows]
        messages = [r["messages"] for r in rows if "messages" in r]
        stats[split] = {
            "rows": len(rows),
            "formats": dict(sorted(Counter(row_format(r) for r in rows).items())),
            "with_system": sum(m[0]["role"] == "system" for m in messages),
            "multi_turn": sum(sum(x["role"] == "user" for x in m) > 1 for m in messages),
            "categories": dict(sorted(Counter(r["category"] for r in rows).items())),
            "words": (min(words), statistics.median(words), max(words)),
            "distinct_prompts": len({first_user_text(r) for r in rows}),
        }
    stats["prompts"] = {"rows": len(data["prompts"])}
    return stats


def format_stats(stats: dict) -> str:
    lines = []
    for split in ("train", "eval"):
        s = stats[split]
        lo, med, hi = s["words"]
        lines += [f"{split}: {s['rows']} rows, {s['distinct_prompts']} distinct prompts, "
                  f"words per row min/median/max {lo}/{med:g}/{hi}",
                  "  formats: " + ", ".join(f"{k} {v}" for k, v in s["formats"].items())
                  + f" (messages: {s['with_system']} with system, {s['multi_turn']} multi-turn)",
                  "  categories: " + ", ".join(f"{k} {v}" for k, v in s["categories"].items())]
    lines.append(f"prompts: {stats['prompts']['rows']} demo prompts")
    return "\n".join(lines)


def _readme(data: dict[str, list[dict]], seed: int, tables: Tables) -> str:
    stats = summarize(data)
    train, eval_ = stats["train"], stats["eval"]
    heldout = "\n".join(f"- {slot}: " + ", ".join(map(str, values))
                        for slot, values in tables.heldout.items() if values)
    categories = "\n".join(f"| {c} | {n} | {eval_['categories'].get(c, 0)} |" for c, n in train["categories"].items())
    template = (tables.directory / "README.template.md").read_text(encoding="utf-8")
    return template.format(seed=seed, train=train, eval=eval_, demo_rows=stats["prompts"]["rows"],
                           pretrain_rows=len(data["pretrain"]), other_company=tables.other.company,
                           topics=len(train["categories"]), system_prompts=len(tables.system_prompts),
                           heldout=heldout, categories=categories)


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(strict_json(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def _file_bytes(seed: int = SEED, tables_dir: Path = TABLES_DIR) -> dict[str, bytes]:
    """{relative path: content} of every file the generator writes."""
    tables = load_tables(tables_dir)
    data = generate(seed, tables)
    out = {FILES[key]: _jsonl(data[key]) for key in ("train", "eval", "prompts", "pretrain")}
    out[FILES["readme"]] = _readme(data, seed, tables).encode("utf-8")
    return out


def write(out_dir: Path = REPO_ROOT, seed: int = SEED, tables_dir: Path = TABLES_DIR) -> list[Path]:
    """Write all files under out_dir (the repo root by default); returns their paths."""
    paths = []
    for rel, content in _file_bytes(seed, tables_dir).items():
        path = Path(out_dir) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)  # bytes, so line endings stay "\n" on every platform
        paths.append(path)
    return paths


def check(out_dir: Path = REPO_ROOT, seed: int = SEED, tables_dir: Path = TABLES_DIR) -> list[str]:
    """Relative paths of files that are missing or differ from what `write` would produce."""
    root = Path(out_dir)
    return [rel for rel, content in _file_bytes(seed, tables_dir).items()
            if not (root / rel).is_file() or (root / rel).read_bytes() != content]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.publish.datagen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT,
                        help="root the data/ paths are relative to (default: the repo root)")
    parser.add_argument("--tables", type=Path, default=TABLES_DIR, help="folder of the YAML tables")
    parser.add_argument("--seed", type=int, default=SEED)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="compare instead of writing")
    mode.add_argument("--stats", action="store_true", help="print statistics, write nothing")
    args = parser.parse_args(argv)

    try:
        if args.stats:
            print(format_stats(summarize(generate(args.seed, load_tables(args.tables)))))
            return 0
        if args.check:
            differing = check(args.out_dir, args.seed, args.tables)
            for rel in differing:
                print(f"differs from generator output: {rel}", file=sys.stderr)
            if not differing:
                print("data files are up to date")
            return 1 if differing else 0
        for path in write(args.out_dir, args.seed, args.tables):
            print(f"wrote {path}")
    except TableError as exc:  # a table mistake is the maintainer's to fix: show where, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    run_main(main)
