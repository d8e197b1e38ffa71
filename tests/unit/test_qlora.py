"""Quantised fine-tuning (QLoRA): the config's quantisation and optimizer fields, the planner's 4-bit and
8-bit base bytes against the tensors bitsandbytes really holds, the LAN cluster guide's configuration
planned, and one short training run of that configuration with the tiny model substituted."""

import json
import math

import pytest

from distlab.config import ConfigError, from_dict, load_config
from distlab.paths import EVAL_FILE, REPO_ROOT

LAN_CONFIG = REPO_ROOT / "lib" / "distlab" / "configs" / "lan_qlora_7b.yaml"

BAD_SETTINGS = [
    ({"quantization": "nf4", "lora": False}, "TrainConfig: quantization='nf4' needs lora=true"),
    ({"quantization": "int8", "lora": False}, "quantization='int8' needs lora=true"),
    ({"quantization": "fp4"}, "quantization='fp4' is not accepted: expected one of none, nf4, int8"),
    ({"double_quant": "maybe"}, "double_quant='maybe' is not accepted: expected true or false"),
    ({"quant_compute_dtype": "int4"}, "quant_compute_dtype='int4' is not accepted: expected one of auto, fp32"),
    ({"quant_compute_dtype": "bf16"}, "quant_compute_dtype='bf16' applies to quantization=nf4 only"),
    ({"optimizer": "adam8"}, "optimizer='adam8' is not accepted: expected one of adamw, adamw_8bit, paged_adamw_8bit"),
    ({"quantization": "nf4", "strategy": "zero3"}, "quantization='nf4' runs with strategy single, ddp, fsdp"),
    ({"quantization": "int8", "strategy": "fsdp"}, "quantization='int8' with strategy='fsdp': FSDP shards a 4-bit"),
    ({"optimizer": "adamw_8bit", "strategy": "zero2"}, "optimizer='adamw_8bit' runs with strategy single or ddp"),
    ({"optimizer": "paged_adamw_8bit", "fused_optimizer": True}, "fused_optimizer=true is torch AdamW's"),
]


@pytest.mark.parametrize("values, message", BAD_SETTINGS, ids=[str(v) for v, _ in BAD_SETTINGS])
def test_a_bad_quantisation_setting_is_one_line_naming_the_field(values, message):
    with pytest.raises(ConfigError) as err:
        from_dict(values, sources={k: "--set" for k in values})
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("quantization, double_quant", [("nf4", True), ("nf4", False), ("int8", True)])
def test_planned_base_bytes_match_what_bitsandbytes_holds(quantization, double_quant):
    """The quantised projections (packed values + absmax / double-quantisation constants, or int8 + row scales)
    and the layers left unquantised (embedding = tied LM head, norms, biases: fp32 after k-bit preparation),
    each within 5% of the planner's; the whole base too (through plan_memory)."""
    from peft import prepare_model_for_kbit_training

    from distlab import models
    from distlab.measure.state import base_weight_bytes
    from distlab.planning.plan import is_quantised, plan_memory, quantised_tensor_bytes
    from distlab.planning.shapes import parameter_layout

    model = models.load_model(None, quantization=models.quantization_config(quantization, double_quant))
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    measured = base_weight_bytes(model)
    layout = [p for p in parameter_layout(model.config, 16, ["q_proj", "v_proj"]) if not p.trainable]
    planned = {"quantised": sum(quantised_tensor_bytes(p, quantization, double_quant) for p in layout
                                if is_quantised(p)),
               "unquantised": sum(quantised_tensor_bytes(p, quantization, double_quant) for p in layout
                                  if not is_quantised(p))}
    for part in planned:
        assert measured[part] == pytest.approx(planned[part], rel=0.05), (part, measured, planned)
    whole = plan_memory(model.config, dtype=quantization, lora_r=16, lora_targets=["q_proj", "v_proj"],
                        double_quant=double_quant)
    assert sum(measured.values()) == pytest.approx(whole.weights, rel=0.05)
    n_quantised = sum(p.numel for p in layout if is_quantised(p))
    # what "4-bit" hides: the constants (12% of the payload without double quantisation, 3% with it)
    bits = measured["quantised"] * 8 / n_quantised
    assert {"nf4": 4.0, "int8": 8.0}[quantization] < bits < {"nf4": 4.6, "int8": 8.2}[quantization]


def test_the_lan_guides_configuration_is_planned_and_recommended(capsys):
    from distlab.commands import plan

    cfg = load_config(LAN_CONFIG)
    assert (cfg.quantization, cfg.double_quant, cfg.lora_targets, cfg.grad_accum, cfg.optimizer,
            cfg.activation_checkpointing, cfg.seq_len) == ("nf4", True, ["q_proj", "v_proj"], 8,
                                                           "paged_adamw_8bit", True, 2048)
    assert plan.main(["--config", str(LAN_CONFIG)]) == 0
    out = capsys.readouterr().out
    # the 4-bit replica fits the 8 GB cards
    assert "RTX 4070 Laptop GPU: 6.5 GiB usable" in out and "does NOT fit" not in out
    assert "recommended: ddp with 4-bit weights" in out
    from distlab.cli import UsageError

    with pytest.raises(UsageError, match="--devices 'RTX 4070:eight': expected NAME:GB"):
        plan.main(["--config", str(LAN_CONFIG), "--devices", "RTX 4070:eight"])


def test_fsdp_shards_a_4bit_base_and_its_load_so_scenario_3_fits(capsys):
    """The LAN guide's Scenario 3 (13B on its 12/8/8 GB cards): a 4-bit replica fits only the 12 GB card, so one
    replica per GPU finds nothing. FSDP sharding the 4-bit base (FSDP + QLoRA) brings a step under an 8 GB card's
    usable memory, and its load too: each GPU packs one weight at a time and keeps its share
    (distlab.sharded_load; distlab.planning.load), so the verdict, which takes the larger, is FSDP + QLoRA. The
    planner divides only the packed values: every rank keeps each tensor's constants whole."""
    from distlab.commands import plan
    from distlab.planning.advice import recommend
    from distlab.planning.cards import LAN_CLUSTER
    from distlab.planning.memory import GIB
    from distlab.planning.plan import plan_memory, quantised_parts
    from distlab.planning.shapes import LLAMA2_13B, parameter_layout

    q_v = dict(lora_r=16, lora_targets=["q_proj", "v_proj"], optimizer="adamw8bit")
    before = recommend(LLAMA2_13B, LAN_CLUSTER, shard_quantised=False, **q_v)
    after = recommend(LLAMA2_13B, LAN_CLUSTER, **q_v)
    assert (before.label, after.label) == ("nothing fits", "fsdp with 4-bit weights")
    sharded_4bit = after.decision.option("fsdp", 0.5)
    assert sharded_4bit.load.device < sharded_4bit.plan.total < 6.5 * GIB
    assert "Shard a 4-bit base (FSDP + QLoRA)" in after.reasoning[-1]
    assert "-> FSDP with 4-bit weights" in after.reasoning[-1]
    layout = [p for p in parameter_layout(LLAMA2_13B, 16, ["q_proj", "v_proj"]) if not p.trainable]
    values, constants = (sum(part) for part in zip(*(quantised_parts(p, "nf4") for p in layout)))
    sharded = plan_memory(LLAMA2_13B, strategy="fsdp", world_size=3, dtype="nf4", **q_v)
    assert sharded.weights == pytest.approx(values / 3 + constants, rel=1e-3)
    # the config file runs it: the plan command plans FSDP's shards, and its verdict takes the larger (the step)
    assert plan.main(["--config", str(LAN_CONFIG.with_name("lan_qlora_13b_fsdp.yaml"))]) == 0
    out = capsys.readouterr().out
    assert "sharded by FSDP over 3 GPUs" in out and "while the model loads (slices)" in out
    assert "does NOT fit" not in out and "recommended: fsdp with 4-bit weights" in out


@pytest.mark.slow
def test_the_lan_configuration_trains_with_the_tiny_model(tmp_path):
    """The LAN configuration's settings (nf4 base, LoRA q/v, paged 8-bit AdamW, checkpointing, accumulation) on the
    tiny model, one CPU process, a few steps: the held-out loss falls, and the optimizer is bitsandbytes'."""
    import bitsandbytes as bnb

    from distlab import train as train_mod
    from distlab.strategies.single import SingleDevice

    eval_rows = tmp_path / "eval.jsonl"
    eval_rows.write_text("".join(EVAL_FILE.read_text().splitlines(keepends=True)[:24]))
    cfg = load_config(LAN_CONFIG, {"model": None, "device": "cpu", "dtype": "auto", "quant_compute_dtype": "auto",
                                   "seq_len": 128, "micro_batch_size": 2, "grad_accum": 2, "epochs": 0.05,
                                   "lr": 1e-2, "warmup_steps": 1, "logging_steps": 1, "checkpoint_steps": 0,
                                   "eval_file": str(eval_rows), "save_model": False, "progress": False,
                                   "num_threads": 1, "output_dir": str(tmp_path / "run")})
    seen = {}

    class Watched(SingleDevice):
        def prepare(self, model, choice, config):
            model, optimizer, scheduler = super().prepare(model, choice, config)
            seen["optimizer"] = optimizer
            return model, optimizer, scheduler

    result = train_mod.train(cfg, Watched())
    assert isinstance(seen["optimizer"], bnb.optim.PagedAdamW8bit)
    assert result.eval_loss_after < result.eval_loss_before - 0.05, (result.eval_loss_before, result.eval_loss_after)
    start = [json.loads(line) for line in result.log_path.read_text().splitlines() if '"start"' in line][0]
    assert start["config"]["quantization"] == "nf4" and start["steps_per_epoch"] > 0
    # the configuration counts in epochs: a twentieth of one here, as optimizer steps
    assert cfg.epochs == 0.05
    assert result.steps == start["config"]["max_steps"] == math.ceil(0.05 * start["steps_per_epoch"])
