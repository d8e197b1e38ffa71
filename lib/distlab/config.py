"""The run spec: one dataclass that every strategy and notebook reads, loadable from YAML."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from distlab import yaml_input
from distlab.paths import EVAL_FILE, RUNS_DIR, TRAIN_FILE

# The one list of strategies (distlab.strategies maps each name to its class; the launcher and the
# planner read the names here, without importing torch).
STRATEGY_NAMES: tuple[str, ...] = ("single", "ddp", "fsdp", "zero2", "zero3", "pipeline", "ds_pipeline", "tp",
                                   "fsdp_tp")
PIPELINE_STRATEGIES: tuple[str, ...] = ("pipeline", "ds_pipeline")  # the world is split into stages
TP_STRATEGIES: tuple[str, ...] = ("tp", "fsdp_tp")  # every layer split over a tensor-parallel group
# The models known by name, read here without importing torch: the offline default, the random-weight presets
# and the pretrained bases that come from a package. distlab.models builds each, and checks this list against its own.
MODEL_PRESETS: tuple[str, ...] = ("distlab-tiny", "qwen2.5-0.5b-random", "distlab-tiny-random", "nanochat-d20-random",
                                  "smollm2-135m-instruct")

# DeepSpeed settings distlab's DeepSpeed config uses, which the memory planner plans with too.
ZERO3_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold default (elements)


def zero_bucket_elements(n_trained: int) -> int:
    """Elements per DeepSpeed reduce/all-gather bucket in distlab's config: DeepSpeed's default 5e8,
    or the trained weight count when that is smaller (a bucket never holds more than that, and
    DeepSpeed allocates 5e8 elements, 2 GB in fp32, even for a tiny model). Even, as it requires."""
    n = int(min(5e8, max(int(n_trained), 2)))
    return n + n % 2

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
    labels: str = "replies"  # the tokens the loss is taken on: replies (the assistant's) | all (pretraining-style)
    # what is trained
    lora: bool = True  # False: full fine-tuning
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    fast_dropout: bool = True  # LoRA dropout from 16-bit coins, 4 per random draw (distlab.dropout)
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # quantised fine-tuning (QLoRA): the frozen base's decoder projections stored by bitsandbytes, loaded through
    # transformers' BitsAndBytesConfig and PEFT's prepare_model_for_kbit_training; LoRA only (a 4/8-bit weight
    # has no gradient). Embeddings, norms, biases and the LM head stay in the run's dtype.
    quantization: str = "none"  # none | nf4 (4-bit NormalFloat, blocks of 64 weights) | int8 (LLM.int8())
    double_quant: bool = True  # nf4: quantise the per-block scales too (8-bit, QLoRA's double quantisation)
    quant_compute_dtype: str = "auto"  # what nf4 layers dequantise to for their matmuls; auto: the run's dtype
    # adamw: torch's; adamw_8bit: bitsandbytes' blockwise 8-bit moments (tensors under 4096 elements keep fp32
    # ones); paged_adamw_8bit: the same, its state in CUDA unified memory that pages to the host under pressure.
    # On a CPU there is nothing to page to: it runs as adamw_8bit (bitsandbytes allocates ordinary host memory).
    optimizer: str = "adamw"
    # batch: global_batch_size (rows per optimizer step, all ranks together) wins over grad_accum
    micro_batch_size: int = 4
    grad_accum: int = 1
    global_batch_size: int | None = None
    # optimisation
    max_steps: int = 100
    # passes over the training rows. When set it decides the step count, ceil(epochs x steps per epoch), resolved
    # once the data is read (steps per epoch depend on the rows, packing, batch and world size) and printed;
    # max_steps is then not used (as global_batch_size wins over grad_accum).
    epochs: float | None = None
    lr: float = 2e-4
    weight_decay: float = 0.01
    warmup_steps: int = 10
    max_grad_norm: float = 1.0
    seed: int = 42
    # execution
    strategy: str = "single"
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | auto-bf16 | fp32 | bf16-autocast | bf16 | fp16-autocast (distlab.device.choose_device)
    activation_checkpointing: bool = False
    fused_optimizer: bool = False  # AdamW as one fused kernel per step (CUDA): no per-tensor launches
    compile: bool = False  # torch.compile each decoder layer, fullgraph (one compiled graph serves them all)
    # the loss's cross entropy over labelled positions: chunked (a slice of rows at a time, so the tokens x
    # vocabulary fp32 logits never exist whole; distlab.lm_loss) | plain (all labelled rows' logits at once)
    cross_entropy: str = "chunked"
    master_weights: bool = False  # with dtype=bf16: the optimizer steps an fp32 copy of every trained weight
    num_threads: int | None = None  # None: keep torch's (torchrun sets OMP_NUM_THREADS=1)
    collective_timeout_s: int = 300  # a rank waiting longer than this in a collective fails the job
    measure_comm: bool = False  # time gradient all-reduces separately (ddp; serialises comm and compute)
    # DDP gradient compression (chapter 05), a torch DDP comm hook: fp16 | bf16 (each bucket cast to 2 bytes) |
    # powersgd (rank-`powersgd_rank` factors of each gradient matrix, error feedback); None: fp32 all-reduce
    ddp_comm_hook: str | None = None
    powersgd_rank: int = 1
    # uneven data parallelism (chapter 05): each rank's share of the global batch, e.g. [2, 1] (normalised;
    # one per data-parallel rank); None: equal shares. The loss stays normalised by global tokens.
    rank_shares: list[float] | None = None
    # sharding (chapter 03: FSDP2 and DeepSpeed ZeRO)
    # fsdp: free each layer's gathered weights after forward, re-gather in backward
    fsdp_reshard_after_forward: bool = True
    # zero2/zero3: optimizer state and update on the CPU (DeepSpeed offload_optimizer)
    zero_offload_optimizer: bool = False
    # fsdp: weights, gradients and optimizer state of every shard kept in host memory, each layer copied to
    # the GPU when it runs (FSDP2's CPUOffloadPolicy); GPUs only: on a CPU they are in host memory already
    fsdp_cpu_offload: bool = False
    # record the bytes of weights, gradients and optimizer state each rank holds (result JSON)
    measure_state: bool = False
    # pipeline (chapter 04): the micro-batches of one step are the loop's grad_accum micro-batches of
    # micro_batch_size rows (m = grad_accum, or global_batch_size / micro_batch_size); every stage sees them all
    pipeline_stages: int | None = None  # pipeline/ds_pipeline: stages (None: one per rank; pure pipeline)
    # pipeline: "1f1b" | "gpipe" | "interleaved" (2 model chunks per rank); ds_pipeline always runs DeepSpeed's 1F1B
    pipeline_schedule: str = "1f1b"
    stage_layers: list[int] | None = None  # decoder layers per stage, e.g. [3, 1]; None: balanced by count
    # tensor parallelism (chapters 07, 08): ranks per tensor-parallel group; None: all ranks (tp), 2 (fsdp_tp)
    tp_size: int | None = None
    # tp / fsdp_tp: activations between blocks sharded along the sequence (norms on s / tp tokens); all-gather
    # and reduce-scatter replace each block's all-reduce
    sequence_parallel: bool = False
    # tp: the vocabulary split too: embedding rows, LM head columns, and the loss computed from the logit slices
    # (torch's loss_parallel); off: embedding, head and loss whole on every rank
    vocab_parallel: bool = False
    # fault tolerance
    checkpoint_steps: int = 0  # 0: no periodic checkpoints
    keep_checkpoints: int = 2
    # true: continue from the newest complete checkpoint in output_dir, if any, when the run that wrote it had
    # this run's settings (distlab.checkpoint.fingerprint; else the run stops, naming the fields that differ);
    # "force": continue it even so (run_metadata.json lists the fields); false: start over
    resume: bool | str = True
    # outputs
    output_dir: str = str(RUNS_DIR / "default")
    logging_steps: int = 5
    eval_at_start: bool = True
    eval_at_end: bool = True
    save_model: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        # Built in code (a notebook, a test) the values are checked too; from_dict checks first, naming the source.
        for name in FIELDS:
            setattr(self, name, check_field(name, getattr(self, name), "TrainConfig"))
        if self.sequence_parallel and self.strategy not in TP_STRATEGIES:
            raise ConfigError(f"TrainConfig: sequence_parallel=true needs strategy tp or fsdp_tp, "
                              f"not {self.strategy!r}")
        if self.vocab_parallel and self.strategy != "tp":
            raise ConfigError(f"TrainConfig: vocab_parallel=true needs strategy=tp, not {self.strategy!r}")
        _check_quantised(self)
        _check_master_weights(self)
        if self.ddp_comm_hook and self.strategy != "ddp":  # other strategies would ignore it without a word
            raise ConfigError(f"TrainConfig: ddp_comm_hook={self.ddp_comm_hook!r} needs strategy=ddp "
                              f"(strategy={self.strategy!r} does not all-reduce gradients through DDP)")
        if self.zero_offload_optimizer and self.strategy not in ("zero2", "zero3"):
            raise ConfigError(f"TrainConfig: zero_offload_optimizer=true needs strategy zero2 or zero3 "
                              f"(strategy={self.strategy!r} has no DeepSpeed optimizer to offload)")
        if self.fsdp_cpu_offload and self.strategy != "fsdp":
            raise ConfigError(f"TrainConfig: fsdp_cpu_offload=true needs strategy=fsdp (strategy={self.strategy!r}; "
                              "for DeepSpeed use zero_offload_optimizer)")

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
# Where a bitsandbytes base runs: a replica per rank, or (nf4 only) sharded by FSDP2 (FSDP + QLoRA): fully_shard
# cuts each 4-bit weight's packed bytes on dim 0 and leaves them uncast (not floating point); the per-block
# constants stay whole on every rank (bitsandbytes keeps them on the module). LLM.int8()'s row scales live on the
# weight itself and FSDP2 would drop them, and bitsandbytes' 8-bit AdamW updates whole tensors: both stay unsharded.
QUANTISED_STRATEGIES = ("single", "ddp", "fsdp")
SHARDED_QUANTISATIONS = ("nf4",)
OPTIMIZER_8BIT_STRATEGIES = ("single", "ddp")


def _check_quantised(cfg: TrainConfig) -> None:
    """The quantisation and optimizer fields against the rest: one line naming the field at fault."""
    q = cfg.quantization
    if q != "none" and not cfg.lora:
        raise ConfigError(f"TrainConfig: quantization={q!r} needs lora=true: a {q} base weight has no gradient, "
                          "so only LoRA adapters over it can be trained (or set quantization=none)")
    if q != "none" and cfg.strategy not in QUANTISED_STRATEGIES:
        raise ConfigError(f"TrainConfig: quantization={q!r} runs with strategy "
                          f"{', '.join(QUANTISED_STRATEGIES)} (a replica per rank, or FSDP2's shards), "
                          f"not {cfg.strategy!r}")
    if q not in ("none", *SHARDED_QUANTISATIONS) and cfg.strategy == "fsdp":
        raise ConfigError(f"TrainConfig: quantization={q!r} with strategy='fsdp': FSDP shards a 4-bit base "
                          f"(quantization=nf4); an int8 weight's row scales would be lost (use single or ddp)")
    if cfg.quant_compute_dtype != "auto" and q != "nf4":
        raise ConfigError(f"TrainConfig: quant_compute_dtype={cfg.quant_compute_dtype!r} applies to "
                          f"quantization=nf4 only (quantization={q!r}); leave it auto")
    if cfg.optimizer != "adamw" and cfg.fused_optimizer:
        raise ConfigError(f"TrainConfig: fused_optimizer=true is torch AdamW's fused kernel; "
                          f"optimizer={cfg.optimizer!r} is bitsandbytes' (set one of them)")
    if cfg.optimizer != "adamw" and cfg.strategy not in OPTIMIZER_8BIT_STRATEGIES:
        raise ConfigError(f"TrainConfig: optimizer={cfg.optimizer!r} runs with strategy "
                          f"{' or '.join(OPTIMIZER_8BIT_STRATEGIES)}, not {cfg.strategy!r} (which shards or splits "
                          "the optimizer state its own way); use adamw")


# Where master_weights runs: strategies whose optimizer is a plain torch optimizer over each rank's local weights
# (distlab.master_weights wraps it). DeepSpeed (zero2, zero3, ds_pipeline) keeps fp32 masters of its own; FSDP's
# checkpoints map optimizer state to the model's weights by identity, which masters are not (and FSDP2 keeps fp32
# shards itself with dtype=bf16-autocast); the pipeline and tensor-parallel optimizers have not been tried with it.
MASTER_WEIGHT_STRATEGIES = ("single", "ddp")


def _check_master_weights(cfg: TrainConfig) -> None:
    """master_weights against dtype, strategy and optimizer: one line naming the field at fault."""
    if not cfg.master_weights:
        return
    if cfg.dtype != "bf16":
        raise ConfigError(f"TrainConfig: master_weights=true needs dtype='bf16' (weights stored in bf16), not "
                          f"{cfg.dtype!r}: other dtypes keep fp32 weights, which are their own masters")
    if cfg.strategy not in MASTER_WEIGHT_STRATEGIES:
        raise ConfigError(f"TrainConfig: master_weights=true runs with strategy "
                          f"{' or '.join(MASTER_WEIGHT_STRATEGIES)}, not {cfg.strategy!r} (its optimizer is not a "
                          "plain torch optimizer over the local weights; for fsdp use dtype=bf16-autocast, whose "
                          "shards are fp32)")
    if cfg.optimizer != "adamw":
        raise ConfigError(f"TrainConfig: master_weights=true steps torch AdamW on the masters, not "
                          f"optimizer={cfg.optimizer!r}; use optimizer=adamw")
    if cfg.lora:
        raise ConfigError("TrainConfig: master_weights=true applies to full fine-tuning (lora=false): the LoRA "
                          "adapters of a bf16 run are fp32 already, their own masters")


class ConfigError(ValueError):
    """A config value that cannot be used: the message names its source (file:line or --set), the field,
    the value and what is accepted."""


# ----------------------------------------------------------------------------- types and ranges
# YAML 1.1 reads `2e-4` (no dot) as a string, and `--set` values arrive as YAML: every value is converted
# to its field's declared type here, so lr=2e-4 is the float every user means, and max_steps=abc fails now,
# not deep in the loop.

_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def _to_int(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            v = _to_float(v)
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    raise TypeError("an integer")


def _to_float(v: Any) -> float:
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            raise TypeError("a number") from None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    raise TypeError("a finite number")


def _to_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, (str, int)) and str(v).strip().lower() in _TRUE | _FALSE:
        return str(v).strip().lower() in _TRUE
    raise TypeError("true or false")


def _to_str(v: Any) -> str:
    if isinstance(v, (str, Path)):
        return str(v)
    if isinstance(v, (int, float)) and not isinstance(v, bool):  # output_dir: 2024 means the folder "2024"
        return str(v)
    raise TypeError("a string")


def _to_list(item):
    def convert(v: Any) -> list:
        if isinstance(v, str):  # --set lora_targets=q_proj,v_proj
            v = [part for part in (p.strip() for p in v.split(",")) if part]
        if not isinstance(v, (list, tuple)):
            raise TypeError("a list")
        return [item(x) for x in v]
    return convert


def _to_resume(v: Any) -> bool | str:
    if isinstance(v, str) and v.strip().lower() == "force":
        return "force"
    return _to_bool(v)


_CONVERT = {"bool | str": _to_resume,  # resume: true, false or "force"
            "int": _to_int, "float": _to_float, "bool": _to_bool, "str": _to_str,
            "list[str]": _to_list(_to_str), "list[int]": _to_list(_to_int),
            "list[float]": _to_list(_to_float)}


def _at_least(n):
    return lambda v: v >= n, f">= {n}"


def _positive():
    return lambda v: v > 0, "> 0"


def _one_of(*names):
    return lambda v: v in names, "one of " + ", ".join(names)


def _known_model(v: str) -> bool:
    """A folder holding a model, a known preset name, or a plausible hub id (owner/name)."""
    if Path(v).expanduser().is_dir():
        if not (Path(v).expanduser() / "config.json").is_file():
            raise TypeError(f"the folder {v} holds no config.json (not a saved model)")
        return True
    presets = set(MODEL_PRESETS)
    if v in presets:
        return True
    if v.startswith(("/", ".", "~")) or v.count("/") > 1:
        raise TypeError(f"no such folder {v} (and not a hub id of the form owner/name, nor a preset: "
                        f"{', '.join(sorted(presets))})")
    if not _HUB_ID.fullmatch(v) or "--" in v or ".." in v:
        raise TypeError(f"neither an existing folder, nor a hub id of the form owner/name, nor a preset "
                        f"({', '.join(sorted(presets))})")
    return True


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


def is_hub_id(model: str | None) -> bool:
    """Whether a model name means the Hugging Face hub: of the form owner/name and not an existing folder
    (presets have no '/'). Only such a name may make from_pretrained reach the network."""
    return bool(model) and not Path(model).expanduser().exists() and _HUB_ID.fullmatch(model) is not None

# field -> (test, what is accepted); a field not listed is only converted to its type
RULES = {
    "model": (_known_model, "an existing model folder, a hub id owner/name, or a preset name"),
    "attn_implementation": _one_of("varlen", "sdpa", "eager", "flash_attention_2", "flash_attention_3",
                                   "flex_attention"),
    "seq_len": _at_least(1), "overlong": _one_of("truncate", "reject", "error"),
    "labels": _one_of("replies", "all"),
    "lora_r": _at_least(1), "lora_alpha": _positive(), "lora_dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "lora_targets": (lambda v: len(v) > 0, "a non-empty list of module names"),
    "quantization": _one_of("none", "nf4", "int8"), "quant_compute_dtype": _one_of("auto", "fp32", "bf16", "fp16"),
    "optimizer": _one_of("adamw", "adamw_8bit", "paged_adamw_8bit"),
    "cross_entropy": _one_of("chunked", "plain"),
    "micro_batch_size": _at_least(1), "grad_accum": _at_least(1), "global_batch_size": _at_least(1),
    "max_steps": _at_least(1), "epochs": _positive(), "lr": _positive(), "weight_decay": _at_least(0),
    "warmup_steps": _at_least(0),
    "max_grad_norm": _positive(), "seed": _at_least(0),
    "strategy": _one_of(*STRATEGY_NAMES),
    "device": (lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?", v) is not None, "auto, cpu, cuda or cuda:N"),
    "dtype": _one_of("auto", "auto-bf16", "fp32", "bf16-autocast", "bf16", "fp16-autocast"),
    "num_threads": _at_least(1), "collective_timeout_s": _at_least(1),
    "ddp_comm_hook": _one_of("fp16", "bf16", "powersgd"), "powersgd_rank": _at_least(1),
    "rank_shares": (lambda v: len(v) > 0 and min(v) > 0, "a non-empty list of positive numbers"),
    "pipeline_stages": _at_least(1), "pipeline_schedule": _one_of("1f1b", "gpipe", "interleaved"),
    "stage_layers": (lambda v: len(v) > 0 and min(v) >= 1, "a non-empty list of layer counts >= 1"),
    "tp_size": _at_least(1), "checkpoint_steps": _at_least(0), "keep_checkpoints": _at_least(1),
    "resume": (lambda v: True, "true, false or force"),
    "output_dir": (lambda v: v.strip() != "", "a folder path"), "logging_steps": _at_least(1),
}


def _accepted(name: str) -> str:
    kind = str(FIELDS[name].type)
    optional = kind.endswith(" | None")
    base = kind.removesuffix(" | None")
    rule = RULES.get(name, (None, ""))[1]
    text = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
            "list[str]": "a list of strings", "list[int]": "a list of integers"}.get(base, base)
    text = f"{text} {rule}" if rule.startswith((">", "in ")) else (rule or text)  # "an integer >= 1"
    return text + (", or null" if optional else "")


def check_field(name: str, value: Any, source: str = "config") -> Any:
    """`value` converted to field `name`'s declared type and checked against its range; ConfigError if not."""
    kind = str(FIELDS[name].type)
    if value is None or (kind.endswith(" | None") and isinstance(value, str) and value.strip().lower() in
                         ("null", "none", "~", "")):
        if kind.endswith(" | None"):
            return None
        raise ConfigError(f"{source}: {name}=None is not accepted: expected {_accepted(name)}")
    convert = _CONVERT.get(kind.removesuffix(" | None"))
    try:
        converted = convert(value) if convert else value
        test = RULES.get(name)
        if test and not test[0](converted):
            raise TypeError(_accepted(name))
    except TypeError as e:
        if name == "model":  # which of folder / hub id / preset it failed to be
            raise ConfigError(f"{source}: model={value!r}: {e}") from None
        raise ConfigError(f"{source}: {name}={value!r} is not accepted: expected {_accepted(name)}") from None
    return converted


def from_dict(values: dict[str, Any], source: str = "config", sources: dict[str, str] | None = None) -> TrainConfig:
    """A TrainConfig from field values; `sources` names where each value came from (else `source`)."""
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        where = (sources or {}).get(unknown[0], source)
        where = source if where.startswith(source) else where  # the file, not a line: the key is the mistake
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    checked = {k: check_field(k, v, (sources or {}).get(k, source)) for k, v in values.items()}
    return TrainConfig(**checked)


def _key_lines(text: str) -> dict[str, int]:
    """field -> line (1-based) in a YAML mapping, for messages that point at the line."""
    try:
        node = yaml_input.compose(text, "config")
    except yaml_input.YamlInputError:
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}


def load_config(path: str | Path, overrides: dict[str, Any] | None = None,
                override_source: str = "--set") -> TrainConfig:
    path = Path(path)
    try:
        text = yaml_input.read_text(path)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file: {e.strerror or e}") from None
    except yaml_input.YamlInputError as e:
        raise ConfigError(str(e)) from None
    try:
        values = yaml_input.load(text, str(path)) or {}
    except yaml_input.YamlInputError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value, got {type(values).__name__}")
    lines = _key_lines(text)
    sources = {k: f"{path}:{lines[k]}" if k in lines else str(path) for k in values}
    sources.update({k: override_source for k in overrides or {}})
    values.update(overrides or {})
    return from_dict(values, source=str(path), sources=sources)


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` from the command line; the value is read as YAML (numbers, bools, lists), then converted
    to the field's type when the config is built."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if key not in FIELDS:
        raise ConfigError(f"--set {text!r}: unknown field {key!r}; known: {', '.join(FIELDS)}")
    try:
        return key, yaml_input.load(raw, f"--set {key}")
    except yaml_input.YamlRefusedError as e:  # a bomb or a nest: refused, not judged as a plain string
        raise ConfigError(str(e)) from None
    except yaml_input.YamlInputError:
        return key, raw  # a plain string the field's check will judge
