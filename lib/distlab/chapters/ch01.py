"""Chapter 01 (one device): the plumbing of the single-device baseline notebook.

The optimizer step drawn (draw_optimizer_step); the few-step run the hand-written loop is checked
against (check_config, compare_losses); MFU beside HFU (throughput_table); the loss figure; key-fact
accuracy on template and paraphrased questions as one table, and beside the 4-bit base's (quality_table);
the demo answers side by side; a real step's activations by micro-batch size, and the 7B LoRA plan drawn
against the LAN cluster's cards. A real optimizer step's memory in the planner's terms, and the QLoRA ladder of
such steps, are distlab.step_memory (which `python -m distlab.bench.memory_recipes` runs too)."""

from __future__ import annotations

import dataclasses
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib.patches import FancyBboxPatch

from distlab import keyfacts
from distlab.config import TrainConfig
from distlab.device import choose_device
from distlab.generate import keyfact_accuracy, read_fact_rows, side_by_side
from distlab.lm_loss import CausalLMWithLoss
from distlab.metrics import read_log
from distlab.paths import EVAL_FILE, PARAPHRASES
from distlab.planning import cards
from distlab.planning.load import plan_load
from distlab.planning.memory import breakdown_table
from distlab.planning.plan import estimate_training_memory
from distlab.planning.shapes import LLAMA2_7B
from distlab.step_memory import measure_training_memory
from distlab.strategies import make_strategy
from distlab.train import train

# --------------------------------------------------------------------------- the idea, drawn

def draw_optimizer_step(micro_batches: int = 2):
    """One optimizer step of distlab.train as boxes and arrows: micro-batches -> forward/backward
    (summed token losses) -> gradients accumulate -> divide by the step's label tokens -> clip -> AdamW
    step -> learning-rate schedule. Returns the figure."""
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.9 * micro_batches))
    ax.set_axis_off()
    ax.set_xlim(-0.1, 10)
    ax.set_ylim(-0.85, micro_batches - 0.5)

    def box(x, y, text, color, w=1.75, h=0.62):
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.05", fc=color, ec="0.3"))
        ax.text(x, y, text, ha="center", va="center", fontsize=8)

    def arrow(x0, y0, x1, y1):
        ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(arrowstyle="->", color="0.3"))

    mid = (micro_batches - 1) / 2
    for i in range(micro_batches):
        y = micro_batches - 1 - i
        box(0.9, y, f"micro-batch {i + 1}\n(packed rows)", "#dbe9f6")
        box(3.0, y, "forward: sum of\ntoken losses", "#fde2c8")
        box(5.1, y, "backward of\nsum / N_labels", "#fde2c8")
        arrow(1.8, y, 2.1, y)
        arrow(3.9, y, 4.2, y)
        arrow(6.0, y, 6.45, mid)
    box(7.2, mid, "grads add up\nin .grad", "#e2f0d9", w=1.4)
    box(8.95, mid + 0.45, "clip to\nmax norm", "#e2f0d9", w=1.5, h=0.55)
    box(8.95, mid - 0.45, "AdamW step,\nLR schedule", "#e2f0d9", w=1.5, h=0.55)
    arrow(7.9, mid, 8.2, mid + 0.35)
    arrow(8.95, mid + 0.15, 8.95, mid - 0.15)
    ax.text(5, -0.72, "N_labels = label tokens of the whole step (every micro-batch): the step's loss is "
            "the mean over those tokens, however the batch is split", ha="center", fontsize=8, style="italic")
    ax.set_title(f"one optimizer step with {micro_batches} micro-batches (gradient accumulation)", fontsize=10)
    return fig


# --------------------------------------------------------------------------- the mechanism, checked

def check_config(cfg: TrainConfig, steps: int, grad_accum: int, output_dir) -> TrainConfig:
    """A few steps of `cfg` with accumulation, no held-out evaluation and nothing saved: the run the
    hand-written loop is compared with, step by step."""
    return cfg.replace(max_steps=steps, grad_accum=grad_accum, eval_file=None, save_model=False, progress=False,
                       logging_steps=1, output_dir=str(output_dir))


def compare_losses(hand: list[float], cfg: TrainConfig) -> pd.DataFrame:
    """Run distlab.train on `cfg` and set its logged per-step losses beside the hand-written loop's."""
    library = [r["loss"] for r in read_log(train(cfg).log_path)]
    table = pd.DataFrame({"step": range(1, len(hand) + 1), "hand-written loop": hand, "distlab.train": library})
    table["difference"] = (table["hand-written loop"] - table["distlab.train"]).abs()
    return table


# --------------------------------------------------------------------------- measurements

def throughput_table(start: dict, steps: pd.DataFrame) -> pd.Series:
    """MFU and HFU of a run beside the FLOPs per token they count, averaged over the logged steps
    after the first two (which include warm-up)."""
    steady = steps.iloc[2:] if len(steps) > 4 else steps
    return pd.Series({
        "real tokens/s": steady["tokens_per_s"].mean(),
        "model FLOPs per token (MFU)": start["flops_per_token"],
        "executed FLOPs per token (HFU)": start["executed_flops_per_token"],
        "peak FLOP/s (one-thread matmul)": start["peak_flops"],
        "MFU": steady["mfu"].mean(),
        "HFU": steady["hfu"].mean(),
    }, name="single device")


def loss_figure(steps: pd.DataFrame, evals: pd.DataFrame, title: str):
    """Training loss per logged step as a line; held-out loss, measured before and after training
    only, as markers (two measurements are not a curve)."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps["step"], steps["loss"], marker=".", label="training loss (global batch)")
    ax.plot(evals["step"], evals["eval_loss"], "o", ms=8, color="C3", ls="none", label="held-out loss (measured)")
    for s, v in zip(evals["step"], evals["eval_loss"]):
        ax.annotate(f"{v:.2f}", (s, v), textcoords="offset points", xytext=(8, -3), fontsize=8, color="C3")
    ax.margins(x=0.1, y=0.08)  # room for the last marker's label
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def keyfact_table(scores: dict[tuple[str, str], dict]) -> pd.DataFrame:
    """{(prompt set, "before"|"after"): keyfact_accuracy result} as one row per prompt set, with
    accuracy, facts found and facts asked before and after."""
    rows = {}
    for (prompts, when), score in scores.items():
        row = rows.setdefault(prompts, {})
        row[f"accuracy {when}"] = score["accuracy"]
        row[f"found {when}"] = score["found"]
        row["facts asked"] = score["asked"]
        row["questions"] = len(score["rows"])
    columns = ["questions", "facts asked", "found before", "accuracy before", "found after", "accuracy after"]
    table = pd.DataFrame.from_dict(rows, orient="index").rename_axis("question set")
    return table[[c for c in columns if c in table]]  # before training, there is no "after" yet


def score_question_sets(lm, tokenizer, when: str, max_new_tokens: int, template_rows: int | None,
                        paraphrase_rows: int | None) -> dict[tuple[str, str], dict]:
    """Key-fact accuracy of `lm`'s greedy answers on the template questions and the paraphrases:
    {("templates" | "paraphrases", when): keyfact_accuracy result}."""
    return {("templates", when): keyfact_accuracy(lm, tokenizer, EVAL_FILE, max_new_tokens, limit=template_rows),
            ("paraphrases", when): keyfact_accuracy(lm, tokenizer, PARAPHRASES, max_new_tokens, limit=paraphrase_rows)}


def bases_table(scores: dict[str, dict[tuple[str, str], dict]]) -> pd.DataFrame:
    """{base model: {(question set, "before"|"after"): keyfact_accuracy result}} as one `keyfact_table` row per
    base and question set, side by side."""
    return pd.concat({base: keyfact_table(score) for base, score in scores.items()}, names=["base"])


def misses_by_kind(score: dict) -> pd.Series:
    """How a keyfact_accuracy result's questions came out: every fact stated, some missing (the right topic,
    a fact left out), or none stated (in this data, nearly always an answer to another question)."""
    kinds = ["every fact" if not r["missing"] else "none" if r["found"] == 0 else "some missing"
             for r in score["rows"]]
    return pd.Series(kinds).value_counts().reindex(["every fact", "some missing", "none"], fill_value=0)


def quality_table(runs: dict[str, tuple[Any, dict, dict]]) -> pd.DataFrame:
    """{run name: (TrainResult, key-fact score on the template questions, on the paraphrases)} as one row
    per run: held-out loss before and after training, and key-fact accuracy on both question sets."""
    return pd.DataFrame({name: {"held-out loss before": result.eval_loss_before,
                                "held-out loss after": result.eval_loss_after,
                                "accuracy, template questions": templates["accuracy"],
                                "accuracy, paraphrases": paraphrases["accuracy"]}
                         for name, (result, templates, paraphrases) in runs.items()}).T.rename_axis("run")


def demo_table(before: list[dict], after: list[dict], prompt_file) -> pd.DataFrame:
    """The demo prompts' answers before and after side by side, with the facts each should state and
    how many of them each answer states."""
    table = side_by_side(before, after)
    demo_facts = {r["id"]: r["facts"] for r in read_fact_rows(prompt_file)}
    facts = [demo_facts.get(i, []) for i in table["id"]]
    table["facts"] = ["; ".join(f) for f in facts]
    table["before_found"] = [sum(keyfacts.facts_found(a, f)) for a, f in zip(table["before"], facts)]
    table["after_found"] = [sum(keyfacts.facts_found(a, f)) for a, f in zip(table["after"], facts)]
    table["facts_asked"] = [len(f) for f in facts]
    return table


def activation_memory_by_micro_batch(cfg: TrainConfig, micro_batch_sizes) -> pd.Series:
    """Measured activation bytes (MiB) of one step for each micro-batch size."""
    return pd.Series({m: measure_training_memory(cfg.replace(micro_batch_size=m)).measured.activations / 2**20
                      for m in micro_batch_sizes}, name="activations (MiB)").rename_axis("micro-batch size")


def plan_7b_lora():
    """The memory estimate of Llama-2-7B + LoRA r=16 on q,v at micro-batch 1 x 2048 tokens, weights in
    bf16 or 4-bit, activation checkpointing off or on, as a stacked bar chart against the LAN cluster's
    12 GB and 8 GB laptop GPUs, with what the GPU holds while the model loads marked on each bar (plan_load).
    Returns (figure, table in GiB: the step's components, its total and "while loading")."""
    rows, loading = {}, {}
    for bits, label in ((16, "bf16"), (4, "4-bit")):
        for ckpt in (False, True):
            run = dict(weight_bytes=bits / 8, lora_r=16, lora_targets=["q_proj", "v_proj"], trainable_bytes=4,
                       micro_batch=1, seq_len=2048, activation_bytes=2, activation_checkpointing=ckpt)
            name = f"{label}, ckpt {'on' if ckpt else 'off'}"
            rows[name] = estimate_training_memory(LLAMA2_7B, **run)
            loading[name] = plan_load(LLAMA2_7B, **run).device / 2**30
    plan = breakdown_table(rows, unit=2**30, unit_name="GiB").T
    fig, ax = plt.subplots(figsize=(7.5, 3.5))
    plan.drop(columns="total").plot.barh(stacked=True, ax=ax)
    # while the model loads: the whole model, plus one bf16 tensor that bitsandbytes is about to pack
    ax.plot(list(loading.values()), range(len(loading)), "kx", ms=7, label="while loading")
    ax.legend(fontsize=8)
    plan["while loading"] = pd.Series(loading)
    big, small, _ = cards.LAN_CARDS  # the 3070 Ti Laptop GPU has the 4070's 8 GiB
    for x, name, side in ((big.memory_gib, big.name.removeprefix("GeForce "), "left"),
                          (small.memory_gib, "RTX 4070 / 3070 Ti Laptop GPU", "right")):
        ax.axvline(x, color="k", ls="--", lw=1)  # a card's "GB" are GiB (distlab.planning.cards)
        ax.text(x, 1.01, f" {name}: {x:g} GiB ", transform=ax.get_xaxis_transform(), fontsize=7, ha=side,
                va="bottom")
    ax.set_xlabel("GiB per GPU (estimate)")
    ax.set_title("Llama-2-7B + LoRA r=16 (q,v), micro-batch 1 x 2048 tokens", pad=14)
    return fig, plan


# --------------------------------------------------------------------------- the real base's 4-bit round trip

def gguf_grid_steps(model, block: int = 32) -> dict[str, torch.Tensor]:
    """The rounding step of every block of the real base's quantised weights, read back from the
    dequantised values themselves: {parameter name: step per block}.

    Q4_1 stores 32 weights as min + step x code with codes 0..15, the block's smallest weight at code 0
    and its largest at 15, so step = (max - min) / 15. Q8_0 (the token embedding, tied to the LM head)
    stores step x code with codes -127..127 and its largest |weight| at 127, so step = max|w| / 127.
    Norm weights are stored unquantised and have no step. Asserts that every weight of a block sits on
    its grid, which is what makes the steps exact."""
    steps = {}
    for name, p in model.named_parameters():
        if p.ndim != 2 or p.shape[-1] % block:
            continue
        w = p.detach().float().reshape(-1, block)
        if "embed" in name:
            step = w.abs().amax(dim=1) / 127
            codes = w / step[:, None]
        else:
            low = w.amin(dim=1)
            step = (w.amax(dim=1) - low) / 15
            codes = (w - low[:, None]) / step[:, None]
        live = step > 0
        off_grid = (codes[live] - codes[live].round()).abs().max()
        assert off_grid < 1e-2, f"{name}: weights are not on a {block}-weight block grid (off by {off_grid:.3g} steps)"
        steps[name] = step
    return steps


def round_trip_cost(model, data, steps: dict[str, torch.Tensor], seeds=(0, 1), block: int = 32,
                    blocks: int | None = None) -> pd.DataFrame:
    """What rounding to the 4-bit grid costs, estimated without the original weights: the held-out loss
    of the model as shipped, then with a second dose of the same rounding noise (uniform in +-step/2 per
    block, the error of rounding to that grid) added to every quantised weight, once per seed. If rounding
    errors act as independent noise, the second dose raises the loss about as much as the first did.
    Returns one row per setting: held-out loss, and the weights' relative RMS noise. `blocks`: the first
    packed blocks of `data` only (None: all)."""
    data = dataclasses.replace(data, items=data.items[:blocks])
    strategy, choice = make_strategy("single"), choose_device("cpu", "fp32")
    params = dict(model.named_parameters())
    shipped = {name: params[name].detach().clone() for name in steps}
    noise_rms = {}
    for name, step in steps.items():
        w = shipped[name].float().reshape(-1, block)
        noise_rms[name] = float((step.pow(2).mean() / 12).sqrt() / w.pow(2).mean().sqrt())
    wrapped = CausalLMWithLoss(model)
    rows = [{"weights": "as shipped (Q4_1 grid)", "held-out loss": strategy.evaluate(wrapped, data, choice),
             "relative RMS noise of the weights": float(np.mean(list(noise_rms.values())))}]
    try:
        for seed in seeds:
            generator = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, step in steps.items():
                    u = torch.rand(shipped[name].numel() // block, block, generator=generator) - 0.5
                    params[name].copy_(shipped[name] + (u * step[:, None]).reshape(shipped[name].shape))
            rows.append({"weights": f"+ a second dose of rounding noise (seed {seed})",
                         "held-out loss": strategy.evaluate(wrapped, data, choice),
                         "relative RMS noise of the weights": float(np.sqrt(2) * np.mean(list(noise_rms.values())))})
    finally:
        with torch.no_grad():
            for name in steps:
                params[name].copy_(shipped[name])
    return pd.DataFrame(rows).set_index("weights")
