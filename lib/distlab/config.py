"""The run spec: one dataclass that every strategy and notebook reads, loadable from YAML."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from distlab.paths import EVAL_FILE, RUNS_DIR, TRAIN_FILE

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class TrainConfig:
    # model
    model: str | None = None  # None: the offline tiny Qwen2; or an HF id / folder / random preset
    # per-document attention for packed rows (distlab.attention); or "sdpa", "eager"
    attn_implementation: str = "varlen"
    # data
    train_file: str = str(TRAIN_FILE)
    eval_file: str | None = str(EVAL_FILE)
    seq_len: int = 256
    packing: bool = True
    overlong: str = "truncate"  # truncate | reject | error
    # what is trained
    lora: bool = True  # False: full fine-tuning
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    fast_dropout: bool = True  # LoRA dropout from 16-bit coins, 4 per random draw (distlab.dropout)
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # batch: global_batch_size (rows per optimizer step, all ranks together) wins over grad_accum
    micro_batch_size: int = 4
    grad_accum: int = 1
    global_batch_size: int | None = None
    # optimisation
    max_steps: int = 100
    lr: float = 2e-4
    weight_decay: float = 0.01
    warmup_steps: int = 10
    max_grad_norm: float = 1.0
    seed: int = 42
    # execution
    strategy: str = "single"
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | fp32 | bf16-autocast | bf16 | fp16-autocast
    activation_checkpointing: bool = False
    num_threads: int | None = None  # None: keep torch's (torchrun sets OMP_NUM_THREADS=1)
    collective_timeout_s: int = 300  # a rank waiting longer than this in a collective fails the job
    measure_comm: bool = False  # time gradient all-reduces separately (ddp; serialises comm and compute)
    # sharding (chapter 03: FSDP2 and DeepSpeed ZeRO)
    # fsdp: free each layer's gathered weights after forward, re-gather in backward
    fsdp_reshard_after_forward: bool = True
    # zero2/zero3: optimizer state and update on the CPU (DeepSpeed offload_optimizer)
    zero_offload_optimizer: bool = False
    # record the bytes of weights, gradients and optimizer state each rank holds (result JSON)
    measure_state: bool = False
    # pipeline (chapter 04): the micro-batches of one step are the loop's grad_accum micro-batches of
    # micro_batch_size rows (m = grad_accum, or global_batch_size / micro_batch_size); every stage sees them all
    pipeline_stages: int | None = None  # pipeline/ds_pipeline: stages (None: one per rank; pure pipeline)
    pipeline_schedule: str = "1f1b"  # pipeline: "1f1b" | "gpipe" (ds_pipeline always runs DeepSpeed's 1F1B)
    stage_layers: list[int] | None = None  # decoder layers per stage, e.g. [3, 1]; None: balanced by count
    # fault tolerance
    checkpoint_steps: int = 0  # 0: no periodic checkpoints
    keep_checkpoints: int = 2
    resume: bool = True  # continue from the newest complete checkpoint in output_dir, if any
    # outputs
    output_dir: str = str(RUNS_DIR / "default")
    logging_steps: int = 5
    eval_at_start: bool = True
    eval_at_end: bool = True
    save_model: bool = True
    progress: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "TrainConfig":
        return from_dict({**self.to_dict(), **changes})

    def micro_steps(self, world_size: int) -> int:
        """Gradient-accumulation steps per optimizer step for this world size.

        With global_batch_size set, the global batch stays constant whatever the world size:
        accumulation = global / (micro x world), which must divide exactly."""
        if self.global_batch_size is None:
            return self.grad_accum
        per_step = self.micro_batch_size * world_size
        if self.global_batch_size % per_step:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not divisible by micro_batch_size "
                             f"x world_size = {self.micro_batch_size} x {world_size}")
        return self.global_batch_size // per_step


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def from_dict(values: dict[str, Any], source: str = "config") -> TrainConfig:
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ValueError(f"{source}: unknown field(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    return TrainConfig(**values)


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    path = Path(path)
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ValueError(f"{path}{line}: invalid YAML: {getattr(e, 'problem', e)}") from e
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of field: value, got {type(values).__name__}")
    values.update(overrides or {})
    return from_dict(values, source=str(path))


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` from the command line; the value is read as YAML (numbers, bools, lists)."""
    if "=" not in text:
        raise ValueError(f"--set {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw)
