"""The chapter standard: every notebook is a lesson, in the shape the book promises its readers.

What a chapter must hold, checked on the stored (unexecuted) notebooks, so a chapter that stops being a
lesson fails `make test-fast`:

* an opening with what the reader will learn (3-5 outcomes), what it builds on, its run time and
  prerequisites;
* the idea drawn (a `draw_*` call of its chapter module) before it is measured;
* the mechanism written by hand (a code cell tagged `mechanism`);
* a prediction asked for before a measurement (`**Predict.**`);
* 2-4 exercises, each followed by its solution in a collapsed code cell that papermill executes with the
  rest of the notebook, so every solution keeps working: collapsed in the book by the tags `solution` and
  `hide-cell`, and in JupyterLab (which ignores tags) by `metadata.jupyter.source_hidden` and
  `outputs_hidden`; an answer written in words is a markdown cell holding one MyST dropdown (`:::{dropdown}`,
  collapsed in the book) with `metadata.jupyter.source_hidden` (collapsed in JupyterLab). Between a
  solution and the next exercise (or the next section) there is nothing else: no code cell, and no markdown
  that is not such a collapsed answer, also not as text before the next cell's heading;
* takeaways (at most five) and further reading (at least two links);
* short code cells: plumbing lives in `distlab.chapters`, not in the notebook;
* no paragraphs assembled from f-strings in code cells (a reader of the unexecuted notebook must be able
  to read the chapter);
* none of the project's internal words;
* a link to the case study (book/case_studies.md) wherever a markdown cell names one of the five systems the
  chapters follow ("the study", "the LAN cluster guide", ...), and the same in every reader page's paragraph.

Chapters not yet rewritten as lessons are expected failures, each named with the work that rewrites it,
and strict: when one starts passing, the mark must go.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from distlab import paths

MAX_CODE_LINES = 15  # non-blank lines; `parameters` and `mechanism` cells are exempt
EXEMPT_TAGS = {"parameters", "mechanism"}
SOLUTION_TAGS = {"solution", "hide-cell"}
# JupyterLab's collapse flags (nbformat's `jupyter` cell metadata): markdown cells have only the first.
HIDDEN_FLAGS = ("source_hidden", "outputs_hidden")
# A markdown answer collapsed in the book: the whole cell is one MyST dropdown (colon or backtick fence).
DROPDOWN = re.compile(r"\A\s*(?P<fence>:{3,}|`{3,})\{dropdown\}[^\n]*\n.*\n(?P=fence)\s*\Z", re.S)
# A markdown cell that reads as an answer: "Answer", "*Answer.*", "**Solution:**", "(Answer ...", ...
ANSWER_WORDS = re.compile(r"\A[\s*_(]*(answer|solution)\b", re.I)

# Words of the project's own bookkeeping that mean nothing to a reader. A random seed is fine.
INTERNAL_WORDS = [
    (re.compile(r"\bthe seeds?\b(?![ -](value|of the random|for the random))", re.I), "'the seed'"),
    (re.compile(r"\bseeds/", re.I), "the design documents' folder"),
    (re.compile(r"\bseed\s*#?\d{3}\b", re.I), "'seed NNN' (a design document's number)"),
    (re.compile(r"\bgoal\s*:?\s*[\d.]+\s*x\b", re.I), "'goal N.Nx' (a project target)"),
    (re.compile(r"\bObservation\s+\d", re.I), "'Observation N' of an unnamed study"),
    (re.compile(r"\bthe issue\b|\bissue\s*#?\d+", re.I), "a reference to the project's issues"),
    (re.compile(r"FACTS\.md|TEACHING\.md|DEVELOPERS\.md|\bshared/", re.I), "the project's internal notes"),
    (re.compile(r"\bSEED_MODELS\b"), "SEED_MODELS (name the models for what they are: the case studies' models)"),
    (re.compile(r"\bseed['’]s sweep\b", re.I), "'seed's sweep' (name the case study whose sweep it is)"),
]
# Not yet lessons: rewritten by later work (the reason names it). strict: a pass must remove the mark.
NOT_YET_LESSONS: dict[str, str] = {}  # every chapter is a lesson now


def source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def tags(cell) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def hidden(cell, flag: str = "source_hidden") -> bool:
    return cell.get("metadata", {}).get("jupyter", {}).get(flag) is True


def is_solution_code(cell) -> bool:
    """A solution code cell collapsed in the book (its tags) and in JupyterLab (both flags)."""
    return cell["cell_type"] == "code" and SOLUTION_TAGS <= tags(cell) and all(hidden(cell, f) for f in HIDDEN_FLAGS)


def is_collapsed_answer(cell) -> bool:
    """A markdown answer collapsed in the book (one dropdown) and in JupyterLab (source hidden)."""
    return cell["cell_type"] == "markdown" and bool(DROPDOWN.match(source(cell))) and hidden(cell)


def text_before_heading(cell) -> str:
    """A markdown cell's text above its first heading (all of it when it has none)."""
    m = re.search(r"^#{1,6}\s", source(cell), re.M)
    return source(cell)[:m.start()] if m else source(cell)


def headings(text: str, level: int) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(rf"^{'#' * level}\s+(.+)$", text, re.M)]


def section(text: str, title: str) -> str | None:
    """The text under a `##`/`###` heading called `title` (case-insensitive), up to the next heading."""
    m = re.search(rf"^#{{2,3}}\s+{re.escape(title)}\s*$(.*?)(?=^#{{1,6}}\s|\Z)", text, re.M | re.S | re.I)
    return m.group(1) if m else None


def bullets(text: str) -> list[str]:
    return re.findall(r"^\s{0,3}[-*]\s+\S.*$", text, re.M)


def standard_problems(nb_path: Path) -> list[str]:
    """Every way the notebook falls short of the chapter standard, one line each (empty: it meets it)."""
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    cells = nb["cells"]
    problems: list[str] = []
    markdown = [source(c) for c in cells if c["cell_type"] == "markdown"]
    number = nb_path.name[:2]

    # 1. The opening: outcomes, what it builds on, run time and prerequisites.
    opening = "\n".join(markdown[:2])
    if not re.match(rf"#\s+{number}\s+·\s+\S", markdown[0] if markdown else ""):
        problems.append(f"the first cell must open with the title '# {number} · ...'")
    learn = section(opening, "What you will learn")
    if learn is None:
        problems.append("no '## What you will learn' in the opening")
    elif not 3 <= len(bullets(learn)) <= 5:
        problems.append(f"'What you will learn' lists {len(bullets(learn))} outcomes (3 to 5)")
    for title in ("What it builds on", "Run time and prerequisites"):
        if section(opening, title) is None:
            problems.append(f"no '## {title}' in the opening")
    runtime = section(opening, "Run time and prerequisites") or ""
    if runtime and not (re.search(r"2-core", runtime) and re.search(r"\bGPU\b", runtime)):
        problems.append("the run time must be given for a 2-core laptop CPU and for one GPU")

    # 2. The idea drawn, 3. the mechanism by hand, 4. a prediction.
    code = [(i, c) for i, c in enumerate(cells) if c["cell_type"] == "code"]
    if not any(re.search(rf"\bch{number}\.draw_\w+\(", source(c)) for _, c in code):
        problems.append(f"no concept diagram: no call of a ch{number}.draw_* function")
    if not any("mechanism" in tags(c) for _, c in code):
        problems.append("no code cell tagged 'mechanism' (the mechanism written by hand)")
    if not any("**Predict.**" in m for m in markdown):
        problems.append("no '**Predict.**' before a measurement")

    # 5. Exercises, each with an executed, collapsed solution.
    exercise_cells = [i for i, c in enumerate(cells)
                      if c["cell_type"] == "markdown" and re.search(r"^###\s+Exercise\s+\d", source(c), re.M)]
    if not any(re.search(r"^##\s+Exercises\s*$", m, re.M) for m in markdown):
        problems.append("no '## Exercises' section")
    if not 2 <= len(exercise_cells) <= 4:
        problems.append(f"{len(exercise_cells)} exercises ('### Exercise N'): 2 to 4")
    for n, start in enumerate(exercise_cells):
        if n + 1 < len(exercise_cells):
            end = exercise_cells[n + 1]
        else:  # the last exercise runs to the next section (Takeaways): a cell with a `#` or `##` heading
            end = next((i for i in range(start + 1, len(cells)) if cells[i]["cell_type"] == "markdown"
                        and re.search(r"^#{1,2}\s", source(cells[i]), re.M)), len(cells))
        following = cells[start + 1:end]
        solutions = [c for c in following if c["cell_type"] == "code" and SOLUTION_TAGS <= tags(c)]
        title = headings(source(cells[start]), 3)[0]
        if not solutions:
            problems.append(f"'{title}' has no solution cell after it (a code cell tagged solution and hide-cell)")
        elif not any("assert" in source(c) for c in solutions):
            problems.append(f"'{title}': its solution asserts nothing, so it cannot fail")
        first = next((i for i in range(start + 1, end) if any(cells[i] is c for c in solutions)), end)
        for i in range(first, end):  # after the solution: only solution cells and collapsed answers
            c = cells[i]
            if "solution" in tags(c):
                continue  # checked below, wherever it is
            if c["cell_type"] == "code":
                problems.append(f"cell {i}: a code cell after the solution of '{title}' that is not tagged "
                                "solution: JupyterLab shows it, and Run All prints it")
            elif c["cell_type"] == "markdown" and not is_collapsed_answer(c):
                problems.append(f"cell {i}: markdown after the solution of '{title}' that is not a collapsed "
                                "answer (one :::{dropdown} with metadata.jupyter.source_hidden true)")
        if solutions and end < len(cells) and text_before_heading(cells[end]).strip():
            problems.append(f"cell {end}: text above its heading follows the solution of '{title}': an answer? "
                            "Move it to a markdown cell of its own, collapsed (a :::{dropdown} with "
                            "metadata.jupyter.source_hidden true)")
    for i, c in enumerate(cells):  # solutions and answers are collapsed wherever they are
        if "solution" in tags(c) and c["cell_type"] == "code" and not is_solution_code(c):
            problems.append(f"cell {i}: a solution code cell must carry the tags solution and hide-cell "
                            "(collapsed in the book) and metadata.jupyter.source_hidden and outputs_hidden "
                            "true (collapsed in JupyterLab)")
        elif "solution" in tags(c) and c["cell_type"] == "markdown" and not is_collapsed_answer(c):
            problems.append(f"cell {i}: a markdown cell tagged solution must be one :::{{dropdown}} "
                            "(collapsed in the book) with metadata.jupyter.source_hidden true (in JupyterLab)")
        elif c["cell_type"] == "markdown" and ANSWER_WORDS.match(source(c)) and not is_collapsed_answer(c):
            problems.append(f"cell {i}: an answer in plain markdown ({source(c).strip()[:30]!r}): put it in one "
                            ":::{dropdown} Answer with metadata.jupyter.source_hidden true")

    # 6. Takeaways and further reading.
    everything = "\n".join(markdown)
    takeaways = section(everything, "Takeaways")
    if takeaways is None:
        problems.append("no '## Takeaways'")
    elif not 1 <= len(bullets(takeaways)) <= 5:
        problems.append(f"'Takeaways' has {len(bullets(takeaways))} bullets (1 to 5)")
    reading = section(everything, "Further reading")
    links = re.findall(r"\[[^\]]+\]\(https?://[^)\s]+\)", reading or "")
    if reading is None or len(links) < 2:
        problems.append(f"'## Further reading' needs at least two links to papers or documentation ({len(links)})")

    # Rules of the text: short code cells, no prose built in code, no internal words.
    for i, c in code:
        lines = [line for line in source(c).splitlines() if line.strip()]
        if len(lines) > MAX_CODE_LINES and not tags(c) & EXEMPT_TAGS:
            problems.append(f"cell {i}: {len(lines)} code lines (at most {MAX_CODE_LINES} outside "
                            "'mechanism' and 'parameters' cells: move plumbing to distlab.chapters)")
        if re.search(r"\bMarkdown\(", source(c)):
            problems.append(f"cell {i}: builds Markdown in code (claims live in markdown cells)")
    for i, c in enumerate(cells):
        for line_no, line in enumerate(source(c).splitlines(), 1):
            for pattern, what in INTERNAL_WORDS:
                if pattern.search(line):
                    problems.append(f"cell {i} line {line_no}: {what}: {line.strip()[:80]!r}")
    return problems


def chapter_params():
    params = []
    for nb in sorted(paths.NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb")):
        reason = NOT_YET_LESSONS.get(nb.name[:2])
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        params.append(pytest.param(nb, id=nb.stem, marks=marks))
    return params


@pytest.mark.parametrize("notebook", chapter_params())
def test_chapter_meets_the_standard(notebook):
    problems = standard_problems(notebook)
    assert not problems, f"{notebook.name} falls short of the chapter standard:\n  " + "\n  ".join(problems)


def reader_pages() -> list[Path]:
    book = sorted(p for p in paths.BOOK_DIR.glob("*.md"))
    return [*book, paths.NOTEBOOKS_DIR / "README.md", paths.REPO_ROOT / "README.md"]


@pytest.mark.parametrize("page", reader_pages(), ids=lambda p: p.name)
def test_reader_pages_hold_no_internal_words(page):
    if not page.exists():
        pytest.fail(f"{page} is missing")
    found = [f"{page.name}:{n}: {what}: {line.strip()[:80]!r}"
             for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             for pattern, what in INTERNAL_WORDS if pattern.search(line)]
    assert not found, "\n".join(found)


# The case studies: book/case_studies.md describes the five systems the chapters follow. A phrase that names one
# of them without saying what it is must come with a link to its section, in the same markdown cell of a chapter
# or the same paragraph of a reader page (a heading counts with the paragraph under it).
CASE_STUDIES_PAGE = paths.BOOK_DIR / "case_studies.md"
CASE_STUDY_PHRASES = re.compile(
    r"\bstudy\b"  # the DeepSpeed pipeline-vs-FSDP study, "the study's table"
    r"|\bLAN[- ]cluster guide"  # the heterogeneous LAN cluster
    r"|\bScenario \d"  # the LAN cluster's scenarios ("Scenario 3", its 13B run)
    r"|\bSlurm inference report"
    r"|\bKubernetes benchmark"
    r"|\benterprise (?:LoRA \+ DDP )?demo",  # the enterprise assistant
    re.I)
# A Markdown link to the page (`[...](../case_studies.md#section)`, `book/case_studies.md` from the READMEs) or
# a {doc} role naming it.
CASE_STUDY_LINK = re.compile(r"\]\([^)\s]*case_studies\.md(?:#[^)\s]*)?\)|\{doc\}`[^`]*case_studies>?`")
CASE_STUDY_ANCHOR = re.compile(r"\]\([^)\s]*case_studies\.md#([^)\s]+)\)")
CODE_FENCE = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})(?!\{).*?^ {0,3}(?P=fence)[ \t]*$", re.M | re.S)
HEADING_ONLY = re.compile(r"\A(?:[ ]{0,3}#{1,6}\s.*\n?)+\Z")


def without_code(text: str) -> str:
    """Markdown without its fenced code blocks (code holds no links), MyST directives (```{note}) kept."""
    return CODE_FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def paragraphs(text: str) -> list[tuple[int, str]]:
    """A page's blocks between blank lines, with their first line's number; a heading joins the block below."""
    blocks: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    for n, line in enumerate([*without_code(text).splitlines(), ""], 1):
        if line.strip():
            if not current:
                start = n
            current.append(line)
        elif current:
            blocks.append((start, "\n".join(current)))
            current = []
    merged: list[tuple[int, str]] = []
    for start, block in blocks:
        if merged and HEADING_ONLY.match(merged[-1][1]):
            merged[-1] = (merged[-1][0], merged[-1][1] + "\n" + block)
        else:
            merged.append((start, block))
    return merged


def case_study_units(path: Path) -> list[tuple[str, str]]:
    """(where, text) for each unit of reading: a chapter's markdown cells, a page's paragraphs."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        return [(f"cell {i}", without_code(source(c))) for i, c in enumerate(cells) if c["cell_type"] == "markdown"]
    return [(f"line {n}", block) for n, block in paragraphs(path.read_text(encoding="utf-8"))]


def unlinked_case_studies(units: list[tuple[str, str]]) -> list[str]:
    """Each unit that names a case study with no link to the case studies page."""
    return [f"{where}: {m.group(0)!r} in {text[max(0, m.start() - 40):m.end() + 40]!r}"
            for where, text in units
            for m in [CASE_STUDY_PHRASES.search(text)] if m and not CASE_STUDY_LINK.search(text)]


def heading_slugs(text: str) -> set[str]:
    """The anchors MyST (heading_anchors) and GitHub give a page's headings: lower case, spaces to hyphens,
    punctuation dropped."""
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", without_code(text), re.M)}


def case_study_readers() -> list[Path]:
    return [*sorted(paths.NOTEBOOKS_DIR.glob("*.ipynb")), *(p for p in reader_pages() if p != CASE_STUDIES_PAGE)]


@pytest.mark.parametrize("path", case_study_readers(), ids=lambda p: str(p.relative_to(paths.REPO_ROOT)))
def test_a_named_case_study_is_linked(path):
    if not path.exists():
        pytest.fail(f"{path} is missing")
    unlinked = unlinked_case_studies(case_study_units(path))
    assert not unlinked, (f"{path.name} names a case study without linking it (book/case_studies.md, e.g. "
                          "[the pipeline study](../case_studies.md#deepspeed-pipeline-versus-fsdp)):\n  "
                          + "\n  ".join(unlinked))


def test_case_study_links_name_a_section():
    text = CASE_STUDIES_PAGE.read_text(encoding="utf-8")
    assert re.search(r"^myst:\s*\n\s+heading_anchors:\s*[2-6]\b", text, re.M), \
        "case_studies.md must set myst heading_anchors (front matter): the chapters link its sections"
    slugs = heading_slugs(text)
    assert len(slugs) >= 6, slugs  # the title and one section per case study
    broken = [f"{path.name}: #{anchor}" for path in case_study_readers()
              for anchor in CASE_STUDY_ANCHOR.findall(path.read_text(encoding="utf-8")) if anchor not in slugs]
    assert not broken, f"links to sections case_studies.md has not got ({sorted(slugs)}):\n  " + "\n  ".join(broken)


@pytest.mark.parametrize("text, linked", [
    ("As the study found, GA >= 8 wins.", False),
    ("As the [DeepSpeed study](../case_studies.md#deepspeed-pipeline-versus-fsdp) found, GA >= 8 wins.", True),
    ("The LAN-cluster guide plans 7B.", False),
    ("The [LAN cluster guide](../case_studies.md) plans 7B.", True),
    ("See {doc}`case_studies`: the enterprise demo's runs.", True),
    ("The guide's Scenario 3 does not fit.", False),
    ("A Slurm inference report ran it.", False),
    ("Nothing named here, only a random seed.", True),
    ("```bash\npython -m distlab.bench.pipeline_study  # the study's sweep\n```\n", True),
])
def test_the_case_study_check_catches_an_unlinked_name(text, linked):
    assert (unlinked_case_studies([("cell 0", without_code(text))]) == []) == linked


def test_a_page_heading_counts_with_the_paragraph_below():
    page = ("## The enterprise demo's commands\n\nEach follows the [enterprise assistant]"
            "(book/case_studies.md#enterprise-assistant).\n\nThe study said so.\n")
    assert [n for n, _ in paragraphs(page)] == [1, 5]
    assert unlinked_case_studies([(f"line {n}", t) for n, t in paragraphs(page)]) == [
        "line 5: 'study' in 'The study said so.'"]


GOOD = {
    "cells": [
        {"cell_type": "markdown", "metadata": {}, "source":
            "# 09 · A lesson\n\n## What you will learn\n- one\n- two\n- three\n\n## What it builds on\nChapter 08."
            "\n\n## Run time and prerequisites\nTwo minutes on a 2-core laptop; on one GPU: seconds.\n"},
        {"cell_type": "code", "metadata": {"tags": ["mechanism"]}, "source": "x = 1\n", "outputs": []},
        {"cell_type": "markdown", "metadata": {}, "source": "**Predict.** What will x be?"},
        {"cell_type": "code", "metadata": {}, "source": "ch09.draw_idea(x)\n", "outputs": []},
        {"cell_type": "markdown", "metadata": {}, "source": "## Exercises\n\n### Exercise 1. Change x\n"},
        {"cell_type": "code", "metadata": {"jupyter": {"outputs_hidden": True, "source_hidden": True},
                                           "tags": ["solution", "hide-cell"]}, "source": "assert x == 1\n",
         "outputs": []},
        {"cell_type": "markdown", "metadata": {}, "source": "### Exercise 2. Change it again\n"},
        {"cell_type": "code", "metadata": {"jupyter": {"outputs_hidden": True, "source_hidden": True},
                                           "tags": ["solution", "hide-cell"]}, "source": "assert x\n",
         "outputs": []},
        {"cell_type": "markdown", "metadata": {}, "source":
            "## Takeaways\n- x is one\n\n## Further reading\n- [a](https://a.example)\n- [b](https://b.example)\n"},
    ],
    "metadata": {}, "nbformat": 4, "nbformat_minor": 5,
}


def markdown_answer(text: str, *, hidden: bool | None, tagged: bool = False) -> dict:
    metadata = {"jupyter": {"source_hidden": hidden}} if hidden is not None else {}
    if tagged:
        metadata["tags"] = ["solution"]
    return {"cell_type": "markdown", "metadata": metadata, "source": text}


def write(tmp_path, nb) -> Path:
    path = tmp_path / "09_lesson.ipynb"
    path.write_text(json.dumps(nb))
    return path


def test_the_standard_accepts_a_lesson(tmp_path):
    assert standard_problems(write(tmp_path, GOOD)) == []


@pytest.mark.parametrize("break_it, expected", [
    (lambda c: c[0].update(source="# 09 · A lesson\n\nJust a report."), "What you will learn"),
    (lambda c: c[1]["metadata"].update(tags=[]), "mechanism"),
    (lambda c: c[2].update(source="What will x be?"), "Predict"),
    (lambda c: c[3].update(source="plot(x)\n"), "draw_"),
    (lambda c: c[5]["metadata"].update(tags=["solution"]), "no solution cell"),
    (lambda c: c[5].update(source="x\n"), "asserts nothing"),
    (lambda c: c.__delitem__(slice(6, 8)), "1 exercises"),
    (lambda c: c[8].update(source="## Takeaways\n- x\n\n## Further reading\n- [a](https://a.example)\n"),
     "two links"),
    (lambda c: c[3].update(source="\n".join(f"y{i} = {i}" for i in range(16))), "16 code lines"),
    (lambda c: c[3].update(source='display(Markdown(f"x is {x}"))\n'), "builds Markdown"),
    (lambda c: c[2].update(source="**Predict.** As the seed said."), "'the seed'"),
    (lambda c: c[2].update(source="**Predict.** We beat the goal 1.6x."), "goal N.Nx"),
    (lambda c: c[3].update(source="ch09.draw_idea(memory.SEED_MODELS)\n"), "SEED_MODELS"),
    (lambda c: c[2].update(source="**Predict.** What will the seed's sweep show?"), "seed's sweep"),
    # Solutions and answers collapsed in JupyterLab as in the book.
    (lambda c: c[5]["metadata"]["jupyter"].pop("source_hidden"), "cell 5: a solution code cell must carry"),
    (lambda c: c[7]["metadata"]["jupyter"].update(outputs_hidden=False), "cell 7: a solution code cell must carry"),
    (lambda c: c[7]["metadata"].pop("jupyter"), "collapsed in JupyterLab"),
    (lambda c: c.insert(6, markdown_answer("*Answer.* x stays one.", hidden=None)),
     "cell 6: markdown after the solution of 'Exercise 1. Change x'"),
    (lambda c: c.insert(6, markdown_answer("**Answer.** x stays one.", hidden=None)), "an answer in plain markdown"),
    (lambda c: c.insert(6, markdown_answer(":::{dropdown} Answer\nx stays one.\n:::", hidden=False)),
     "not a collapsed answer"),
    (lambda c: c.insert(6, markdown_answer(":::{dropdown} Answer\nx stays one.\n:::\nAnd more.", hidden=True)),
     "not a collapsed answer"),
    (lambda c: c.insert(6, markdown_answer("x stays one.", hidden=True, tagged=True)),
     "a markdown cell tagged solution must be one"),
    (lambda c: c[6].update(source="So x stays one.\n\n### Exercise 2. Change it again\n"),
     "cell 6: text above its heading follows the solution of 'Exercise 1. Change x'"),
    (lambda c: c[8].update(source="(And x stays one.)\n\n" + c[8]["source"]),
     "cell 8: text above its heading follows the solution of 'Exercise 2. Change it again'"),
    (lambda c: c.insert(8, {"cell_type": "code", "metadata": {}, "source": "print(x)\n", "outputs": []}),
     "cell 8: a code cell after the solution of 'Exercise 2. Change it again' that is not tagged solution"),
    (lambda c: c[2].update(source="Solution: x is one."), "an answer in plain markdown"),
])
def test_the_standard_catches_what_it_promises(tmp_path, break_it, expected):
    nb = json.loads(json.dumps(GOOD))
    break_it(nb["cells"])
    problems = standard_problems(write(tmp_path, nb))
    assert any(expected in p for p in problems), problems


def test_a_random_seed_is_not_an_internal_word(tmp_path):
    nb = json.loads(json.dumps(GOOD))
    nb["cells"][2]["source"] = "**Predict.** Same random seed, same data: `seed=42`; the seed value is fixed."
    assert standard_problems(write(tmp_path, nb)) == []


@pytest.mark.parametrize("fence", [":::", "```", "::::"])
def test_the_standard_accepts_an_answer_in_a_collapsed_dropdown(tmp_path, fence):
    nb = json.loads(json.dumps(GOOD))
    answer = markdown_answer(f"{fence}{{dropdown}} Answer\n*Answer.* x stays **one**.\n\nTwo paragraphs.\n{fence}\n",
                             hidden=True, tagged=True)
    nb["cells"][8:8] = [answer, dict(answer, metadata={"jupyter": {"source_hidden": True}})]
    assert standard_problems(write(tmp_path, nb)) == []


def planted(tmp_path, notebook: Path, plant) -> list[str]:
    """The problems of a copy of a chapter (same file name, in tmp_path) with one violation planted."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    plant(nb["cells"])
    copy = tmp_path / notebook.name
    copy.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return standard_problems(copy)


@pytest.mark.parametrize("notebook", sorted(paths.NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem)
@pytest.mark.parametrize("flag", HIDDEN_FLAGS)
def test_a_chapter_with_a_solution_shown_in_jupyterlab_fails(tmp_path, notebook, flag):
    assert planted(tmp_path, notebook, lambda cells: None) == []  # the copy itself meets the standard
    found = {}

    def drop_flag(cells):
        found["index"] = max(i for i, c in enumerate(cells) if c["cell_type"] == "code" and "solution" in tags(c))
        del cells[found["index"]]["metadata"]["jupyter"][flag]

    problems = planted(tmp_path, notebook, drop_flag)
    assert any(p.startswith(f"cell {found['index']}: a solution code cell must carry") for p in problems), problems


def chapters_with_answers_in_words() -> list[Path]:
    return [nb for nb in sorted(paths.NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
            if any(c["cell_type"] == "markdown" and "solution" in tags(c)
                   for c in json.loads(nb.read_text(encoding="utf-8"))["cells"])]


def test_some_chapters_answer_in_words():
    assert {nb.name[:2] for nb in chapters_with_answers_in_words()} >= {"00", "01"}


@pytest.mark.parametrize("notebook", chapters_with_answers_in_words(), ids=lambda p: p.stem)
def test_a_chapter_with_an_answer_shown_in_plain_markdown_fails(tmp_path, notebook):
    found = {}

    def unwrap(cells):  # the first answer back as it was: plain markdown, neither tagged nor hidden
        found["index"] = next(i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and "solution" in tags(c))
        cell = cells[found["index"]]
        body = DROPDOWN.match(source(cell)).group(0).strip().splitlines()[1:-1]
        cell.update(metadata={}, source="\n".join(body))

    problems = planted(tmp_path, notebook, unwrap)
    assert any(p.startswith(f"cell {found['index']}: markdown after the solution of") for p in problems), problems
