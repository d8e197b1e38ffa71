"""What building and loading a model folder share (the default base in distlab.models, the pretrained base in
distlab.pretrained, the inference tests' checkpoint): a file lock, so that torchrun ranks that all ask for a model
at once build it once (build_lock); a finished build put where the old one was in one rename, so a reader never
finds a half-written folder (replace_folder); and transformers' per-load progress bars and notices that are not
ours to fix silenced (quiet_hf). Loads no torch; transformers only when quiet_hf runs.
"""

from __future__ import annotations

import fcntl
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def build_lock(path: Path):
    """Serialise concurrent builds (every torchrun rank may ask for the model at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def replace_folder(tmp: Path, out_dir: Path) -> Path:
    """Put a finished build (tmp) where the old one was: a reader never finds a half-written folder."""
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def quiet_hf() -> None:
    """Per-load progress bars from transformers add nothing but noise to notebook outputs, and
    peft calls a transformers method that transformers 5 deprecates (not ours to fix)."""

    from transformers.utils import logging as hf_logging  # deferred: transformers is slow to import

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*", category=FutureWarning)
