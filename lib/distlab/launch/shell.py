"""One way for every script writer to refuse or quote a value: the torchrun scripts and per-node
folders (torchrun.py), the Slurm job (sbatch.py: submit.sbatch and run.sh) and the Kubernetes Job
with its entrypoint (kubernetes/manifests.py, kubernetes/pod.py) all check their specs and quote
their values here, so that a rule tightened here holds for every one of them.

Refused, with one line naming the spec and the field (a SpecError, a ValueError):

- control characters: C0 (NUL, newline, CR, ESC, ...) except tab, DEL, C1 and the Unicode line
  separators. A newline in a value that lands in a comment or an `#SBATCH` line would start a line
  of its own, i.e. a command; the others corrupt terminals and logs. Tab is ordinary whitespace:
  quoting keeps it literal and it never ends a line, so a quoted argument may hold one;
- values longer than MAX_VALUE_CHARS: no path or argument of a launch is longer (PATH_MAX is 4096),
  and a single argument over 128 KiB fails only at exec time, on the cluster;
- secrets, by one rule for names and values (scripts and manifests are committed and copied between
  machines). An environment variable's name is refused when one of its underscore-separated words is
  TOKEN, SECRET, PASSWORD, PASSWD, PASSPHRASE, KEY, APIKEY, CREDENTIAL(S), AUTH or PRIVATE, or ends in
  TOKEN, SECRET, PASSWORD or APIKEY (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, MYTOKEN). Whole
  words, not substrings, so TOKENIZERS_PARALLELISM and MONKEY_PATCH pass. Names of the communication
  and runtime libraries (NCCL_*, GLOO_*, TORCH_*, TORCHELASTIC_*, CUDA_*, HIP_*, ROCR_*, OMP_*) are
  tuning knobs, never credentials, and are exempt. Any value that looks like a well-known credential
  (hf_..., ghp_..., github_pat_..., sk-..., AKIA..., xox?-..., a PEM private key) is refused too. Pass
  secrets through the caller's environment, which the scripts inherit (`HF_TOKEN=... script.sh`);
- bash's own variables (IFS, PATH, BASH_ENV, ...) as exported names: they change how the script runs.

`check_fields` applies the character, length and secret rules to every string a spec holds (found by
dataclass introspection, so a new field is covered without being listed); each spec then checks its
own fields' meaning. Every value that lands in a shell script goes through `quote` (shlex.quote):
single quotes, in which nothing expands. Values the shell does not parse, such as `#SBATCH` directives
that sbatch splits itself, must be `check_word`s instead: no whitespace, quotes, backslash or `%`.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Iterable, Mapping

MAX_VALUE_CHARS = 4096

IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # a shell variable's name
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")  # python -m's argument
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a job's name, a file named after it

_CONTROL_RE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
_NOT_A_WORD = set(" \t'\"\\%")  # sbatch splits directives at whitespace, strips quotes, expands %

# Variables bash itself uses or owns; exporting them changes how the script runs.
SHELL_ENV = frozenset({"IFS", "PATH", "SHELLOPTS", "BASHOPTS", "BASH_ENV", "ENV", "CDPATH", "PWD", "OLDPWD",
                       "HOME", "PPID", "UID", "EUID", "BASHPID", "SECONDS", "RANDOM", "LINENO", "PS4"})
SECRET_WORDS = {"TOKEN", "TOKENS", "SECRET", "SECRETS", "PASSWORD", "PASSWORDS", "PASSWD", "PASSPHRASE",
                "KEY", "KEYS", "APIKEY", "CREDENTIAL", "CREDENTIALS", "AUTH", "PRIVATE"}
SECRET_SUFFIXES = ("TOKEN", "SECRET", "PASSWORD", "APIKEY")
NON_SECRET_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "TORCHELASTIC_", "CUDA_", "HIP_", "ROCR_", "OMP_")
_SECRET_VALUE_RE = re.compile(
    r"hf_[A-Za-z0-9]{30,}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}|sk-[A-Za-z0-9_-]{20,}"
    r"|AKIA[0-9A-Z]{16}|xox[abprs]-[A-Za-z0-9-]{10,}|-----BEGIN [A-Z ]*PRIVATE KEY-----")


class SpecError(ValueError):
    """An invalid spec: `.field` names the offending field, the message starts `<Spec>.<field>: `."""

    spec = "spec"

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{self.spec}.{field_name}: {message}")


def show(value, limit: int = 60) -> str:
    """repr(value), cut short: an error message stays one short line whatever the value."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(str(value))} characters)"


def quote(value) -> str:
    """The one way a value enters a shell script: a single word, nothing in it expanded."""
    return shlex.quote(str(value))


def literal_note(values: Iterable[str]) -> list[str]:
    """The lines that tell shellcheck a single-quoted $ or ` is literal on purpose (it would suspect a
    forgotten expansion), or none when no value holds one. Before a script's first command: file-wide."""
    if any("$" in v or "`" in v for v in values):
        return ["# Single-quoted values are literal on purpose: $ and ` in them are not expanded.",
                "# shellcheck disable=SC2016"]
    return []


def looks_like_secret_name(name: str) -> bool:
    """The name rule in the module docstring: whole words of the name, library prefixes exempt."""
    upper = name.upper()
    if upper.startswith(NON_SECRET_PREFIXES):
        return False
    words = [w for w in upper.split("_") if w]
    return any(w in SECRET_WORDS or w.endswith(SECRET_SUFFIXES) for w in words)


def looks_like_secret_value(value: str) -> bool:
    """A well-known credential's shape anywhere in the value."""
    return bool(_SECRET_VALUE_RE.search(value))


def check_text(error: type[SpecError], field: str, value, *, allow_empty: bool = False,
               what: str | None = None) -> None:
    """A string that may go into a script, quoted or in a comment: the rules in the module docstring."""
    label = f"{what}: " if what else ""
    if not isinstance(value, str):
        raise error(field, f"{label}{show(value)} is not a string")
    if not value and not allow_empty:
        raise error(field, f"{label}must not be empty")
    if len(value) > MAX_VALUE_CHARS:
        raise error(field, f"{label}{show(value)} is longer than {MAX_VALUE_CHARS} characters")
    bad = _CONTROL_RE.search(value)
    if bad:
        raise error(field, f"{label}{show(value)} contains the control character {bad.group()!r} "
                           "(a newline would start a line of its own in the script)")
    if looks_like_secret_value(value):
        raise error(field, f"{label}the value looks like a credential; scripts must hold no secrets (pass it "
                           "through the caller's environment)")


def check_word(error: type[SpecError], field: str, value) -> None:
    """check_text, and no character that a directive parser other than the shell would split or expand."""
    check_text(error, field, value)
    bad = sorted(_NOT_A_WORD & set(value))
    if bad:
        raise error(field, f"{show(value)} contains {' '.join(map(repr, bad))}: it goes unquoted into an "
                           "#SBATCH directive, which Slurm splits at whitespace and expands % in")


def check_fields(error: type[SpecError], spec, prefix: str = "") -> None:
    """check_text on every string `spec` holds (fields, list items, dict keys and values, and the fields of
    nested dataclasses that do not validate themselves); other types are left to the spec's own checks."""
    for f in dataclasses.fields(spec):
        value, name = getattr(spec, f.name), prefix + f.name
        if isinstance(value, str):
            check_text(error, name, value, allow_empty=True)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, str):
                    check_text(error, name, item, allow_empty=True)
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str):
                    check_text(error, name, key, allow_empty=True)
                if isinstance(item, str):
                    check_text(error, name, item, allow_empty=True, what=show(key, 40))
        elif dataclasses.is_dataclass(value) and not hasattr(value, "validate"):
            check_fields(error, value, prefix=f"{name}.")


def check_env(error: type[SpecError], field: str, env: Mapping, reserved: Iterable[str] = (),
              reserved_why: str = "is set by the script itself") -> None:
    """Variables a script exports: valid names, none the script or bash sets, no secret, values as text."""
    reserved = set(reserved)
    for name, value in env.items():
        if not isinstance(name, str) or not IDENT_RE.match(name):
            raise error(field, f"{show(name)} is not a valid shell variable name")
        if name in reserved:
            raise error(field, f"{name} {reserved_why}")
        if name in SHELL_ENV:
            raise error(field, f"{name} is one of bash's own variables")
        if looks_like_secret_name(name):
            raise error(field, f"{name} looks like a secret; scripts must hold none: pass it from the caller's "
                               f"environment instead ({name}=... script.sh)")
        if not isinstance(value, str):
            raise error(field, f"{name}: value {show(value)} is not a string")
        check_text(error, field, value, allow_empty=True, what=name)


def check_module(error: type[SpecError], field: str, value) -> None:
    check_text(error, field, value)
    if not MODULE_RE.match(value):
        raise error(field, f"{show(value)} is not a dotted Python module name")
