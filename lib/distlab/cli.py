"""How every `python -m distlab.*` command ends on bad input: one line `<prog>: error: <message>`, exit 2.

    if __name__ == "__main__":
        run_main(main)

User-facing errors are the library's ValueError family (ConfigError, DataError, LaunchSpecError,
ResultLogError, KubeJobError, NetworkPresetError, ...: each message already names the file, line or field)
and OSError (a missing or unreadable input). argparse's own errors become the same one line. A launched job
that failed (distlab.launch.process.RunFailed) is one line too, with exit status 1: the input was fine, the run was not.
Anything else is a bug and keeps its traceback. `--debug` (before any `--`) or DISTLAB_DEBUG=1 shows the
traceback of every error.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Callable, NoReturn, Sequence

USAGE_EXIT, FAILED_EXIT = 2, 1


class UsageError(ValueError):
    """Bad arguments, found by argparse or by a command's own checks."""


def _argparse_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    raise UsageError(f"{message} (see {prog_name()} --help)")


def prog_name() -> str:
    """`python -m distlab.x` for the running module, else the script's name."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return f"python -m {spec.name.removesuffix('.__main__')}" if spec and spec.name else os.path.basename(sys.argv[0])


def split_debug(argv: Sequence[str]) -> tuple[list[str], bool]:
    """argv without `--debug` (only before a `--`: what follows belongs to a wrapped command)."""
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    debug = "--debug" in argv[:end]
    return [a for i, a in enumerate(argv) if not (i < end and a == "--debug")], debug


def run_main(main: Callable[..., int | None], argv: Sequence[str] | None = None, prog: str | None = None,
             sigterm_exits: bool = False) -> NoReturn:
    """sys.exit(main(argv)), with user errors as one line on stderr and exit status 2.

    `sigterm_exits`: a SIGTERM (timeout, a scheduler) raises SystemExit(143) in the main thread, so a command
    that launches jobs through distlab.launch.process kills their process groups on the way out instead of
    leaving them running (the runner cleans up on any exception)."""
    if sigterm_exits:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    argv, debug = split_debug(sys.argv[1:] if argv is None else argv)
    debug = debug or os.environ.get("DISTLAB_DEBUG") == "1"
    prog = prog or prog_name()
    original = argparse.ArgumentParser.error
    if not debug:
        argparse.ArgumentParser.error = _argparse_error  # one line instead of usage + error
    try:
        code = main(argv)
    except (ValueError, OSError) as e:
        if debug:
            raise
        _one_line(prog, e)
        sys.exit(USAGE_EXIT)
    except RuntimeError as e:
        if debug or type(e).__name__ != "RunFailed":  # by name: importing the runner here would load psutil
            raise
        _one_line(prog, e)
        sys.exit(FAILED_EXIT)
    finally:
        argparse.ArgumentParser.error = original
    sys.exit(code or 0)


def _exit_on_sigterm(signum, frame) -> NoReturn:
    raise SystemExit(128 + signum)


def _one_line(prog: str, error: BaseException) -> None:
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, OSError) and error.filename and str(error.filename) not in text:
        text = f"{error.filename}: {text}"
    print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
