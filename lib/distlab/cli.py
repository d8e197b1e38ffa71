"""How every command ends on bad input: one line `<prog>: error: <message>`, exit 2. A `python -m distlab.<module>`
program ends with

    if __name__ == "__main__":
        run_main(main)

and the user's commands (`python -m distlab <command>`) go through run_main in distlab/__main__.py.

User-facing errors are the library's ValueError family (ConfigError, DataError, LaunchSpecError,
ResultLogError, KubeJobError, NetworkPresetError, ...: each message already names the file, line or field)
and OSError (a missing or unreadable input). argparse's own errors become the same one line. A launched job
that failed (distlab.launch.process.RunFailed) is one line too, with exit status 1: the input was fine, the run was not.
Ctrl-C (KeyboardInterrupt) is `<prog>: interrupted`, exit status 130, after the runner has killed the jobs it
launched. Every float a command accepts goes through `finite_float` (NaN and infinities refused).
Anything else is a bug and keeps its traceback. `--debug` (before any `--`) or DISTLAB_DEBUG=1 shows the
traceback of every error.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from typing import Callable, NoReturn, Sequence

USAGE_EXIT, FAILED_EXIT, INTERRUPTED_EXIT = 2, 1, 130  # 130 = 128 + SIGINT, what a shell reports for Ctrl-C


class UsageError(ValueError):
    """Bad arguments, found by argparse or by a command's own checks."""


class NotFiniteError(UsageError, argparse.ArgumentTypeError):
    """A number option given NaN, an infinity or no number. Both kinds: argparse shows its message as it is
    (ArgumentTypeError) and a command parsing a list by hand catches it as the ValueError it is."""


def finite_float(text: str) -> float:
    """The argparse type of every float option: float() accepts "nan" and "inf", which compare False with every
    bound (so `interval <= 0` lets NaN through) and turn a limit into none; refused here, once."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise NotFiniteError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise NotFiniteError(f"{text!r} is not a finite number")
    return value


def _argparse_error(prog: str, message: str) -> NoReturn:
    raise UsageError(f"{message} (see {prog} --help)")


def prog_name() -> str:
    """`python -m distlab.x` (`python -m distlab` for the command entry point) for the running module, else the
    script's name (`distlab`, the console script)."""
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
        # one line instead of usage + error, naming the prog this run reports as (a command's, not the dispatcher's)
        argparse.ArgumentParser.error = lambda parser, message: _argparse_error(prog, message)
    try:
        code = main(argv)
    except KeyboardInterrupt:
        # Ctrl-C is the user's choice, not a bug: no traceback. Jobs launched through distlab.launch.process
        # were already killed as groups while the exception passed through the runner.
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED_EXIT)
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
