"""Publish the built book to a `gh-pages` branch with ghp-import, the executable-books way.

    python -m distlab.publish.pages --remote REMOTE      (make publish REMOTE=...)

REMOTE is anything `git push` takes: a remote's name (origin), a URL, or a path to a bare repository.
The build is refused, and nothing is pushed, when a committed figure or table is stale or was drawn from
a dirty tree (distlab.publish.freshness): the site would show numbers the code no longer produces.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from distlab import paths
from distlab.cli import run_main
from distlab.provenance import git_commit
from distlab.publish.freshness import stale_outputs

DEFAULT_HTML = paths.BOOK_DIR / "_build" / "html"
BRANCH = "gh-pages"


class PublishRefused(RuntimeError):
    pass


def ghp_import_command() -> list[str]:
    exe = Path(sys.executable).with_name("ghp-import")
    if exe.exists():
        return [str(exe)]
    if shutil.which("ghp-import"):
        return ["ghp-import"]
    raise PublishRefused("ghp-import is not installed (it is in requirements.lock: run `make env`)")


def publish(remote: str, html_dir: str | Path = DEFAULT_HTML, *, repo: str | Path = paths.REPO_ROOT,
            figures_dir: str | Path = paths.FIGURES_DIR, notebooks_dir: str | Path = paths.NOTEBOOKS_DIR,
            branch: str = BRANCH, timeout_s: float = 300) -> str:
    """Commit `html_dir` to `branch` of `repo` (replacing its contents) and push it to `remote`.
    Returns the commit message used. Raises PublishRefused before touching any branch when the
    outputs are stale or dirty, or the site was not built."""
    html_dir = Path(html_dir)
    if not (html_dir / "index.html").exists():
        raise PublishRefused(f"{html_dir}/index.html does not exist: build the site first (make book)")
    problems = stale_outputs(figures_dir, notebooks_dir, root=repo)
    if problems:
        listed = "\n  ".join(map(str, problems[:10])) + ("\n  ..." if len(problems) > 10 else "")
        raise PublishRefused(f"{len(problems)} stale or unclean output(s); run `make book` from a clean commit "
                             f"and commit figures/ first:\n  {listed}")
    commit = git_commit(root=repo)
    if commit.endswith("+dirty") or commit == "unknown":
        raise PublishRefused(f"the tree's inputs have uncommitted changes ({commit}): commit them, then make book")
    message = f"Publish the distlab book built at {commit}"
    # -n: a .nojekyll file, so GitHub Pages serves _static/ and _images/ as they are.
    cmd = [*ghp_import_command(), "-n", "-p", "-f", "-r", remote, "-b", branch, "-m", message, str(html_dir)]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise PublishRefused(f"ghp-import failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
    return message


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.publish.pages", description=__doc__.split("\n\n")[0])
    ap.add_argument("--remote", required=True, help="git remote name, URL or path of a bare repository")
    ap.add_argument("--html-dir", type=Path, default=DEFAULT_HTML, help=f"the built site (default {DEFAULT_HTML})")
    ap.add_argument("--branch", default=BRANCH, help=f"the branch to publish to (default {BRANCH})")
    args = ap.parse_args(argv)
    try:
        message = publish(args.remote, args.html_dir, branch=args.branch)
    except PublishRefused as exc:
        print(f"publish: refused: {exc}", file=sys.stderr)
        return 2
    print(f"publish: pushed {args.html_dir} to {args.remote} {args.branch} ({message})")
    return 0


if __name__ == "__main__":
    run_main(main)
