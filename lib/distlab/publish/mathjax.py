"""A local MathJax for the book, so that pages with math render offline: found ($DISTLAB_MATHJAX or
build/mathjax), installed from npm once (`fetch_mathjax`), and copied into a built site's `_static/`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from distlab import paths
from distlab.launch import process

MATHJAX_VERSION = "3.2.2"
MATHJAX_CDN = "cdn.jsdelivr.net/npm/mathjax"
MATHJAX_NPM_DIR = paths.BUILD_DIR / "mathjax"
# Parts of MathJax's es5 folder a page never loads with the tex-mml-chtml bundle.
_MATHJAX_SKIP = ("sre", "node-main.js", "tex-chtml-full-speech.js", "tex-chtml-full.js", "tex-svg-full.js",
                 "tex-svg.js", "tex-mml-svg.js", "mml-svg.js")


def find_mathjax() -> Path | None:
    """A local MathJax 3 (the folder holding tex-mml-chtml.js): $DISTLAB_MATHJAX, else the copy
    that `fetch_mathjax` installs under build/mathjax. None when there is none."""
    candidates = []
    if os.environ.get("DISTLAB_MATHJAX"):
        env = Path(os.environ["DISTLAB_MATHJAX"])
        candidates += [env, env / "es5", env / "node_modules" / "mathjax" / "es5"]
    candidates.append(MATHJAX_NPM_DIR / "node_modules" / "mathjax" / "es5")
    return next((c for c in candidates if (c / "tex-mml-chtml.js").is_file()), None)


def fetch_mathjax(dest: str | Path = MATHJAX_NPM_DIR, version: str = MATHJAX_VERSION) -> Path | None:
    """Install MathJax from npm into `dest` (build/mathjax) so pages with math render offline."""
    if shutil.which("npm") is None:
        return None
    process.run(["npm", "install", "--prefix", str(dest), "--no-audit", "--no-fund", "--fetch-retries=0",
                "--fetch-timeout=30000", f"mathjax@{version}"], timeout_s=120, echo=False, check=False)
    es5 = Path(dest) / "node_modules" / "mathjax" / "es5"
    return es5 if (es5 / "tex-mml-chtml.js").is_file() else None

def install_mathjax(es5: Path, html_dir: Path) -> None:
    target = html_dir / "_static" / "mathjax"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(es5, target, ignore=lambda d, names: [n for n in names if n in _MATHJAX_SKIP])
