"""Shared fixtures. The default model is built once per machine (cached under build/models)."""

from __future__ import annotations

import os

import pytest

# One thread per process, as on the tutorial's CPU runs: tests that compare numbers across
# processes need the same reduction order, and two cores must serve pytest and its children.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tokenizer():
    from distlab.models import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def tiny_model():
    import torch

    from distlab.models import load_model

    torch.set_num_threads(1)
    model = load_model(None)
    model.eval()
    return model
