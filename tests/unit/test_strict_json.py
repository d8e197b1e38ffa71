"""Strict logs: every JSON the library writes is strict (no bare NaN or Infinity), a step log marks the fields
it wrote as null because they were not finite, and the readers carry such a value on as NaN: no TypeError on
None, never a 0 that looks like a measurement."""

from __future__ import annotations

import ast
import io
import json
import math
from pathlib import Path

import pytest

import distlab
from distlab.commands import accept
from distlab.jsonio import strict_json
from distlab.metrics import StepLog, read_log
from distlab.results import benchmark_report, recorder, schema
from distlab.results.extract import extract_results

PACKAGE = Path(distlab.__file__).parent

# The json.dumps/json.dump calls left plain, by (file under lib/distlab, enclosing function): one call each.
# Digests: their bytes key caches already on disk (other bytes would rebuild or re-run everything) and no
# parser reads them back, so strictness buys nothing there.
DIGESTS = {
    ("publish/freshness.py", "benchmark_inputs"): "digest of a benchmark's module and arguments: keys the "
                                                  "up-to-date check of make benchmarks",
    ("publish/freshness.py", "chapter_inputs"): "digest of a chapter's profile and parameters: keys the chapter "
                                                "cache of make book",
    ("tiny_base.py", "_recipe_hash"): "recipe hash of the built tokenizer and default model under build/models",
    ("inference/run.py", "token_settings"): "prompts_sha256: a resubmitted inference run compares it with the "
                                            "run_settings.json on disk",
    ("inference/stage_weights.py", "random_checkpoint"): "the random checkpoint's stamp, compared as text (never "
                                                         "parsed) with the stamp on disk",
}
ALLOWED = DIGESTS


def plain_json_writes(tree: ast.AST) -> list[tuple[str, int]]:
    """(enclosing function, line) of every json.dumps/json.dump call without allow_nan=False, and of every
    `from json import dump(s)` (which would hide such calls from this check)."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = scope + [node.name]
        if isinstance(node, ast.ImportFrom) and node.module == "json" and {a.name for a in node.names} & {
                "dump", "dumps"}:
            found.append((".".join(scope) or "<module>", node.lineno))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("dump", "dumps")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "json"):
            strict = any(k.arg == "allow_nan" and isinstance(k.value, ast.Constant) and k.value.value is False
                         for k in node.keywords)
            if not strict:
                found.append((".".join(scope) or "<module>", node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, [])
    return found


def test_the_scan_finds_a_plain_json_writer_and_passes_a_strict_one():
    source = '''
import json
from json import dumps
def write(path, x, fh):
    path.write_text(json.dumps(x, indent=1))
    json.dump(x, fh)
    return json.dumps(x, allow_nan=False)
class C:
    def m(self, x):
        print(json.dumps(x))
'''
    assert plain_json_writes(ast.parse(source)) == [("<module>", 3), ("write", 5), ("write", 6), ("C.m", 10)]


def test_every_json_the_library_writes_is_strict():
    """A plain json.dumps writes NaN bare, which jq, a browser or a strict parser rejects: write with
    distlab.jsonio.strict_json, or add a digest to DIGESTS saying why its bytes must stay."""
    calls: dict[tuple[str, str], list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for scope, line in plain_json_writes(ast.parse(path.read_text(), str(path))):
            calls.setdefault((rel, scope), []).append(line)
    unexpected = [f"lib/distlab/{rel}:{line} ({scope}): json.dumps/json.dump without strict_json"
                  for (rel, scope), lines in sorted(calls.items()) for line in lines
                  if (rel, scope) not in ALLOWED or len(lines) > 1]
    assert unexpected == [], "plain JSON writers (bare NaN):\n" + "\n".join(unexpected)
    stale = [f"{rel} ({scope})" for rel, scope in ALLOWED if (rel, scope) not in calls]
    assert stale == [], "allowlisted, but no plain json.dumps there any more (remove the entry):\n" + "\n".join(stale)


def strict_loads(text: str):
    """What jq or a browser accepts: a bare NaN, Infinity or -Infinity fails."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in {text[:80]!r}"))


def test_a_step_log_writes_non_finite_fields_as_null_and_names_them(tmp_path):
    log = StepLog(tmp_path)
    log.write("step", step=3, loss=float("nan"), grad_norm=float("inf"), lr=1e-3, comm_time_s=None,
              losses=[1.0, -math.inf])
    log.write("step", step=4, loss=2.5, grad_norm=1.0, lr=1e-3, comm_time_s=None)
    diverged, fine = [strict_loads(line) for line in log.path.read_text().splitlines()]
    assert diverged["loss"] is None and diverged["grad_norm"] is None and diverged["losses"] == [1.0, None]
    # top-level fields only: comm_time_s was None (not measured) when written, so it is not marked
    assert diverged["non_finite"] == ["loss", "grad_norm"] and diverged["comm_time_s"] is None
    assert "non_finite" not in fine and fine["loss"] == 2.5


def _write_log(folder: Path, losses: list[float]) -> Path:
    log = StepLog(folder)
    log.write("start", world_size=1)
    for step, loss in enumerate(losses, start=1):
        log.write("step", step=step, world_size=1, loss=loss, step_time_s=0.5, tokens=100, tokens_per_s=200.0,
                  peak_mem_bytes=1000, comm_time_s=None, comm_bytes=None)
    log.write("end", final_loss=losses[-1])
    return log.path


def test_read_log_gives_a_marked_null_back_as_nan_and_leaves_an_unmeasured_one_none(tmp_path):
    path = _write_log(tmp_path, [3.0, 2.0, float("nan"), float("inf")])
    steps = read_log(path)
    assert [s["loss"] for s in steps][:2] == [3.0, 2.0]
    assert all(math.isnan(s["loss"]) for s in steps[2:])  # not 0, not None
    assert steps[2]["non_finite"] == ["loss"] and steps[2]["comm_time_s"] is None
    assert math.isnan(read_log(path, event="end")[0]["final_loss"])


@pytest.mark.parametrize("line, problem", [
    ('{"event": "step", "step": 1, "loss": 2.0, "non_finite": ["loss"]}', "field 'loss' is marked non_finite but "
                                                                          "holds 2.0"),
    ('{"event": "step", "step": 1, "non_finite": ["loss"]}', "non_finite names 'loss', which the record does not "
                                                             "have"),
    ('{"event": "step", "step": 1, "loss": null, "non_finite": "loss"}', "non_finite is 'loss', not a list of "
                                                                         "field names"),
])
def test_a_damaged_marker_is_one_line_naming_the_file_and_line(tmp_path, line, problem):
    path = tmp_path / "train_log.jsonl"
    path.write_text('{"event": "start"}\n' + line + "\n")
    with pytest.raises(ValueError) as info:
        read_log(path)
    assert str(info.value) == f"{path}:2: {problem}"


def test_the_summary_of_a_diverged_log_is_nan_not_a_crash_or_zero(tmp_path):
    row = schema.summarise_logs(_write_log(tmp_path, [3.0, 2.0, 1.5, float("nan")]))
    assert math.isnan(row["final_loss"]) and math.isnan(row["mean_loss"])
    assert row["tokens_per_s"] == 200.0 and row["steps_averaged"] == 2  # the timings are still measured


def test_acceptance_names_the_diverged_step(tmp_path):
    _write_log(tmp_path, [3.0, 2.0, 1.5, float("nan")])
    ok, message = accept.check_log_fields(tmp_path, every=1)
    assert not ok
    assert "step 4: loss=nan is not finite" in message and "end: final_loss=nan is not finite" in message


def test_a_result_record_with_a_diverged_step_reads_back_as_nan_through_the_report(tmp_path):
    """rank 0 reads its step log and prints the record (strict); the report reads it back from the log."""
    steps = read_log(_write_log(tmp_path, [3.0, 2.0, 1.5, float("nan")]))
    own = schema.summarise({0: steps})  # what recorder.rank_result computes: it used to fail on a null loss
    assert math.isnan(own["final_loss"])
    rec = {"schema": recorder.SCHEMA, "run": "r", "strategy": "ddp", "mode": "lora", "rank": 0, "world_size": 1,
           "global_batch_size": 8, "steps": [s["step"] for s in steps], "loss": [s["loss"] for s in steps],
           "step_time_s": [s["step_time_s"] for s in steps], "tokens": [s["tokens"] for s in steps],
           "comm_time_s": [None] * 4, "comm_bytes": [None] * 4, "peak_mem_bytes": 1000}
    buf = io.StringIO()
    recorder.emit_result(rec, stream=buf)
    strict_loads(buf.getvalue().splitlines()[1])
    back = extract_results(buf.getvalue(), expected_ranks=1)
    assert back[0]["loss"][:3] == [3.0, 2.0, 1.5] and math.isnan(back[0]["loss"][3])
    row = benchmark_report.run_metrics(back)
    assert math.isnan(row["final_loss"]) and math.isnan(row["mean_loss"])
    curve = benchmark_report.losses_by_run([back])["r"]
    assert curve.isna().tolist() == [False, False, False, True]  # a gap in the plot, not a drop to 0
    diverged = {0: {**back[0], "strategy": "fsdp"}}
    reference = {0: {**back[0], "run": "ref", "loss": [3.0, 2.0, 1.5, 1.2]}}
    agreement = benchmark_report.loss_agreement([diverged, reference], reference="ddp").set_index("strategy")
    # the NaN is the last step's: max() over the differences alone would have kept the largest finite one
    diffs = agreement["max rel. diff vs ddp"]
    assert math.isnan(diffs["fsdp"]) and diffs["ddp"] == 0


def test_strict_json_nulls_non_finite_numbers_at_any_depth():
    record = {"a": float("nan"), "b": [1.0, float("-inf")], "c": {"d": (float("inf"), 2)}, "e": Path("x/y")}
    assert strict_loads(strict_json(record)) == {"a": None, "b": [1.0, None], "c": {"d": [None, 2]}, "e": "x/y"}
