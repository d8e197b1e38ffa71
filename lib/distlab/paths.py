"""Where things live. Everything generated at run time goes under build/ (git-ignored)."""

from __future__ import annotations

import os
from pathlib import Path

# lib/distlab/paths.py -> repo root is two levels above the package folder.
REPO_ROOT = Path(os.environ.get("DISTLAB_ROOT", Path(__file__).resolve().parents[2]))
DATA_DIR = REPO_ROOT / "data"
FIGURES_DIR = Path(os.environ.get("DISTLAB_FIGURES", REPO_ROOT / "figures"))
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
LAUNCH_DIR = REPO_ROOT / "launch"
BOOK_DIR = REPO_ROOT / "book"
BUILD_DIR = Path(os.environ.get("DISTLAB_BUILD", REPO_ROOT / "build"))
MODEL_CACHE = BUILD_DIR / "models"
RUNS_DIR = BUILD_DIR / "runs"
CACHE_DIR = BUILD_DIR / "cache"

TRAIN_FILE = DATA_DIR / "support" / "train.jsonl"
EVAL_FILE = DATA_DIR / "support" / "eval.jsonl"
PARAPHRASES = DATA_DIR / "support" / "paraphrases.jsonl"  # held-out questions written apart from the templates
DEMO_PROMPTS = DATA_DIR / "prompts" / "demo_prompts.jsonl"



def figures_for_notebook(given: str | Path | None = None) -> Path:
    """Where a chapter writes its figures and tables: the folder it was given; figures/ while the book is
    regenerated (distlab.publish.regenerate exports DISTLAB_PROFILE, or DISTLAB_FIGURES for another folder);
    otherwise build/figures/, so a chapter run in JupyterLab never rewrites the committed figures."""
    if given:
        return Path(given)
    if "DISTLAB_FIGURES" in os.environ or "DISTLAB_PROFILE" in os.environ:
        return FIGURES_DIR
    return BUILD_DIR / "figures"


def chapter_folders(given_figures: str | Path | None, chapter: str) -> tuple[Path, Path]:
    """(the chapter's figures folder, figures_for_notebook; build/<chapter>/ for its scripts and traces),
    both created."""
    figures, work = figures_for_notebook(given_figures), BUILD_DIR / chapter
    for folder in (figures, work):
        folder.mkdir(parents=True, exist_ok=True)
    return figures, work
