"""What several chapters share, below them all (a chapter imports no other chapter's module): a run split
over ranks set against one device, as chapters 07 and 08 run it, and the diagrams' common parts.

  run_devices, rank_needs   the devices and dtypes the one-device run and the ranks get on this machine
                            (distlab.machine's `auto`), and what the ranks need of it
  loss_tolerance            the loss difference allowed between runs computing in those dtypes
  loss_comparison           the step losses of one device and of a split run side by side
  allreduce_bytes_per_layer Megatron's tensor-parallel all-reduce bytes of one decoder layer
  RANK_COLORS, save_diagram the two ranks' colours in a diagram; a drawn diagram laid out, saved with its
                            provenance and closed

A chapter's scripts run under torchrun through distlab.launch.scripts."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from distlab.machine import TOLERANCES, AutoParameters, pick
from distlab.metrics import read_log
from distlab.provenance import save_figure

RANK_COLORS = ("C0", "C1")


def save_diagram(fig, path: str | Path, provenance: dict) -> Path:
    """A drawn diagram laid out, saved with its provenance, and closed (the notebook displays the file)."""
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.close(fig)
    return out


def allreduce_bytes_per_layer(batch: int, seq: int, hidden: int, bytes_per_value: int = 4) -> dict[str, int]:
    """Megatron's count: the block outputs (forward) and block input gradients (backward) of attention
    and MLP, each b x s x h values."""
    one = batch * seq * hidden * bytes_per_value
    return {"forward": 2 * one, "backward": 2 * one}


def loss_tolerance(*dtypes: str) -> float:
    """The `auto` loss_atol for runs that compute in `dtypes`: the loosest of their tolerances
    (distlab.machine.TOLERANCES), so a one-device run on a GPU in bf16 beside TP ranks on CPU in fp32 (one GPU:
    the ranks cannot share it) is held to bf16's, and two fp32 runs to fp32's rounding."""
    loose = TOLERANCES["bf16-autocast"]["loss_atol"]  # any dtype but fp32 rounds like bf16 or worse
    return max(TOLERANCES["fp32"]["loss_atol"] if d == "fp32" else loose for d in dtypes)


def run_devices(device: str, dtype: str, auto: AutoParameters) -> tuple[dict[str, str], dict[str, str]]:
    """(the one-device run's device and dtype, the distributed runs'): "auto" takes distlab.machine's choice,
    a GPU for one device where there is one and for the ranks only where each gets its own; an explicit value
    (a profile's, the reader's) applies to both."""
    return ({"device": pick(device, auto.device), "dtype": pick(dtype, auto.dtype)},
            {"device": pick(device, auto.rank_device), "dtype": pick(dtype, auto.rank_dtype)})


def rank_needs(device: str, ranks: int) -> tuple[str, ...]:
    """What `ranks` ranks on `device` need of the machine (distlab.machine.Sections): a GPU each under NCCL,
    nothing on CPU (gloo ranks may share cores: the runs check what is computed, not speed)."""
    return (f"gpus:{ranks}",) if device == "cuda" else ()


def loss_comparison(single_log: str | Path, split_log: str | Path, label: str = "tp, 2 ranks") -> pd.DataFrame:
    """Step losses of one device and of a split run (the steps both ran), and their difference."""
    one = pd.DataFrame(read_log(single_log)).set_index("step")["loss"]
    split = pd.DataFrame(read_log(split_log)).set_index("step")["loss"]
    one = one.loc[one.index.isin(split.index)]
    return pd.DataFrame({"one device": one, label: split, "difference": (split - one).abs()})
