"""The dataset generator: the committed data is exactly its output, it is deterministic, and a broken table
stops it with the file, the entry and the field."""

from __future__ import annotations

import shutil

import pytest
import yaml

from distlab.paths import REPO_ROOT
from distlab.publish import datagen
from distlab.publish.datagen import FILES, TABLES_DIR, TableError, check, generate, load_tables


def test_committed_data_is_what_the_generator_writes():
    differing = check()
    assert differing == [], f"{differing} drifted from data/generator/: run `python -m distlab.publish.datagen`"


def test_check_names_a_file_that_differs(tmp_path):
    for rel in FILES.values():  # the committed files, which are what the generator writes (the test above)
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / rel, tmp_path / rel)
    eval_file = tmp_path / FILES["eval"]
    eval_file.write_bytes(eval_file.read_bytes().replace(b"Okta", b"0kta", 1))
    assert check(tmp_path) == [FILES["eval"]]


def test_generating_twice_gives_the_same_rows():
    tables = load_tables()
    first = generate(tables=tables)
    assert generate(tables=tables) == first
    assert generate(seed=datagen.SEED + 1, tables=tables)["train"] != first["train"]  # the seed is really used


# --------------------------------------------------------------------------------------------
# Broken tables, each in a copy of data/generator/
# --------------------------------------------------------------------------------------------

@pytest.fixture
def tables_copy(tmp_path):
    return shutil.copytree(TABLES_DIR, tmp_path / "generator")


def edit(directory, rel: str, change) -> None:
    """Apply `change` to the parsed YAML of directory/rel and write it back."""
    path = directory / rel
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))


def mfa_intent(index: int, change):
    return "topics/mfa.yaml", lambda doc: change(doc["intents"][index])


def put(container, key, value) -> None:
    container[key] = value


BROKEN = {
    "missing answer": (*mfa_intent(2, lambda i: i.pop("answer")), "mfa/mfa_no_push", "answer", "missing"),
    "unknown field": (*mfa_intent(2, lambda i: i.update(answers=i.pop("answer"))), "mfa/mfa_no_push", "answers",
                      "unknown field"),
    "unknown slot in answer": (*mfa_intent(0, lambda i: i.update(answer=i["answer"] + " Ask {manager}.")),
                               "mfa/mfa_new_phone", "answer", "unknown slot {manager}"),
    "unknown slot in phrasing": (*mfa_intent(1, lambda i: put(i["phrasings"], 1, "new {fone}, need mfa")),
                                 "mfa/mfa_lost_phone", "phrasings[1]", "unknown slot {fone}"),
    "phrasing drops a slot": (*mfa_intent(0, lambda i: put(i["phrasings"], 3, "how to transfer okta verify")),
                              "mfa/mfa_new_phone", "phrasings[3]", "uses slots []"),
    "unbalanced brace": (*mfa_intent(0, lambda i: i.update(answer=i["answer"] + " {phone")),
                         "mfa/mfa_new_phone", "answer", "bad template"),
    "phrasings not a list": (*mfa_intent(2, lambda i: i.update(phrasings="no mfa push on {phone}")),
                             "mfa/mfa_no_push", "phrasings", "must be a list"),
    "phrasing not a string": (*mfa_intent(2, lambda i: put(i["phrasings"], 1, 42)),
                              "mfa/mfa_no_push", "phrasings[1]", "must be a non-empty str"),
    "too few phrasings": (*mfa_intent(2, lambda i: i.update(phrasings=i["phrasings"][:3])),
                          "mfa/mfa_no_push", "phrasings", "at least 4"),
    "duplicate intent name": (*mfa_intent(2, lambda i: i.update(name="forgot_password")),
                              "mfa/forgot_password", "name", "already used in topic password_reset"),
    "held-out value not a value": ("entities.yaml", lambda doc: doc["phone"]["heldout"].append("Nokia 3310"),
                                   "phone", "heldout", "some, not all"),
    "rule on a text slot": ("rules.yaml", lambda doc: doc.update(city=doc.pop("nightly_rate")),
                            "city", None, "whole-number values"),
    "rule cases out of order": ("rules.yaml", lambda doc: doc["leave_days"]["leave_rule"].reverse(),
                                "leave_days/leave_rule", "above", "decreasing thresholds"),
    "general text states a policy": ("general.yaml", lambda doc: doc["entries"][0].update(
        answer=doc["entries"][0]["answer"] + " Passwords expire every 90 days."), "What is a VPN?", "answer",
        "states Acme's fact 'every 90 days'"),
    "unknown product": ("general.yaml", lambda doc: doc["products"].append("Zoom"), None, "products",
                        "'Zoom' is not an Acme fact key"),
    "unknown demo intent": ("shared.yaml", lambda doc: put(doc["demo_intents"], 2, "submit_expenses"),
                            None, "demo_intents[2]", "no intent named 'submit_expenses'"),
}


@pytest.mark.parametrize("rel,change,entry,field,reason", BROKEN.values(), ids=BROKEN.keys())
def test_broken_table_names_file_entry_and_field(tables_copy, rel, change, entry, field, reason):
    edit(tables_copy, rel, change)
    with pytest.raises(TableError) as info:
        load_tables(tables_copy)
    err = info.value
    assert (err.path, err.entry, err.field) == (tables_copy / rel, entry, field), str(err)
    assert reason in err.reason
    assert str(err).startswith(str(tables_copy / rel))


def test_error_message_points_at_the_line_of_the_intent(tables_copy):
    path = tables_copy / "topics" / "mfa.yaml"
    text = path.read_text()
    path.write_text(text.replace("type the 6-digit code", "type the {code}"))
    line = text[:text.index("- name: mfa_no_push")].count("\n") + 1
    with pytest.raises(TableError) as info:
        load_tables(tables_copy)
    assert str(info.value).startswith(f"{path}:{line}: mfa/mfa_no_push: field 'answer': unknown slot {{code}}")


def test_duplicate_key_and_unlisted_topic_file_are_errors(tables_copy):
    path = tables_copy / "topics" / "payroll.yaml"
    path.write_text(path.read_text() + "escalation: a second one\n")
    with pytest.raises(TableError, match=r"payroll\.yaml:\d+: invalid YAML: duplicate key 'escalation'"):
        load_tables(tables_copy)
    shutil.copy(TABLES_DIR / "topics" / "payroll.yaml", path)
    (tables_copy / "topics" / "parking.yaml").write_text("escalation: x\nintents: []\n")
    with pytest.raises(TableError, match=r"shared\.yaml: field 'topics': topics/parking\.yaml is not listed"):
        load_tables(tables_copy)


def test_command_line_reports_a_broken_table_without_a_traceback(tables_copy, capsys):
    edit(tables_copy, *mfa_intent(2, lambda i: i.pop("answer")))
    assert datagen.main(["--check", "--tables", str(tables_copy)]) == 2
    stderr = capsys.readouterr().err
    assert "mfa.yaml" in stderr and "mfa/mfa_no_push: field 'answer': missing" in stderr
