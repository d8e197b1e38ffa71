"""What every pure-pipeline rank does, whichever engine runs its schedule (chapter 04).

Shared by distlab.strategies.pipeline (torch.distributed.pipelining) and
distlab.strategies.ds_pipeline (DeepSpeed's PipelineModule): rank k holds stage k of the split in
distlab.strategies.split; every stage sees the same rows (data-parallel size 1); gradients are
clipped by the global norm over all stages; evaluation is a plain forward through the stages
with sends and receives; saving gathers every stage's part onto rank 0 into one folder that
`from_pretrained` loads, while checkpoints are written stage by stage.

Model chunks. With `virtual` v > 1 (interleaved 1F1B), the model is cut into p v virtual stages and
rank r holds v of them, r, r + p, r + 2p, ... (Megatron-LM's interleaved assignment): `chunks` are
this rank's StageModules in that order, `stage_module` holds them all (one module: the optimizer,
clipping, the activation meter and saving see every parameter of the rank). The token embedding is
on virtual stage 0 (rank 0) and the head on the last one (rank p - 1), as with v = 1.

Loss convention: the last stage returns the summed next-token loss of its micro-batch; the
engine multiplies it by 1 / (label tokens of the whole step), so the gradients are exactly those
of single-device training on the same global batch. A tied input/output embedding (the tiny
Qwen2, many small models) lives on the first and the last stage; under full fine-tuning its two
gradients are summed between those stages before the step, so both copies stay identical (as
Megatron's embedding group does).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distlab.device import DeviceChoice, autocast
from distlab.layer_split import split_layers
from distlab.safe_load import load_tensors
from distlab.strategies.base import DistributedStrategy, load_trained_weights, trained_weights
from distlab.strategies.split import PipelinedModel, RankChunks, StageModule, drop_other_stages, stack_microbatches

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]


class StagedStrategy(DistributedStrategy):
    """A rank that holds one pipeline stage."""

    shards_checkpoint = True  # each stage writes its own weights and optimizer state

    def __init__(self) -> None:
        super().__init__()
        self.cfg = None
        self.choice: DeviceChoice | None = None
        self.stage_index, self.num_stages = 0, 1
        self.stage_module: StageModule | RankChunks | None = None
        self.virtual = 1  # model chunks (virtual stages) per rank
        self.chunks: list[StageModule] = []  # this rank's, in the order data flows through them
        self.chunk_stages: list[int] = []  # their virtual stage indices: rank + k p
        self.schedule_used, self.microbatches = "", 1
        self.tie_group = None  # ranks that sum the tied embedding's gradient (torch pipeline)
        self.tied_param: torch.Tensor | None = None  # trained on both end stages (full fine-tuning)
        self.loss_scale = 1.0  # 1 / label tokens of the current step

    def setup(self, cfg) -> None:
        super().setup(cfg)
        self.cfg = cfg
        self.num_stages = cfg.pipeline_stages or self.world_size
        if self.num_stages != self.world_size:
            raise ValueError(f"pipeline_stages={self.num_stages} on {self.world_size} ranks: this strategy runs a pure "
                             "pipeline (one stage per rank); pipeline x data parallelism is not implemented here")
        if self.num_stages < 2:
            raise ValueError("a pipeline needs at least 2 stages (ranks)")
        self.stage_index = self.rank

    @property
    def data_parallel_size(self) -> int:
        return 1  # every stage sees the same micro-batches

    @property
    def data_parallel_rank(self) -> int:
        return 0

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel replicas: there is one (the stages share the data)."""
        return tensor

    def unwrap(self, model):
        return model

    # `compile` is left out: a stage's layers run under the pipeline schedules, where compiling them has not
    # been tried here
    compiles_layers = False

    def optimizer_options(self, cfg) -> dict:
        return {}  # the plain AdamW per stage: fused_optimizer has not been tried under the pipeline schedules

    def trained_module(self, model):
        return self.stage_module  # this rank's chunks: what it holds of the model

    def place_stage(self, model, choice: DeviceChoice, cfg) -> PipelinedModel:
        """Keep only this rank's stage of the model (the other stages' parts become placeholders); the
        strategy's `keep_stage`, before `parallelize` places what is left on the device."""
        causal = model.causal_lm
        total = self.num_stages * self.virtual
        ranges = split_layers(causal.config.num_hidden_layers, total, cfg.stage_layers)
        self.chunk_stages = [self.stage_index + k * self.num_stages for k in range(self.virtual)]
        self.chunks = [StageModule(causal, ranges[vs], vs == 0, vs == total - 1, cfg.cross_entropy == "chunked")
                       for vs in self.chunk_stages]
        mine = [i for vs in self.chunk_stages for i in ranges[vs]]
        drop_other_stages(causal, mine, self.is_first, self.is_last, self.stage_index)
        stage = self.chunks[0] if self.virtual == 1 else RankChunks(self.chunks)
        self.stage_module, self.choice, self.microbatches = stage, choice, cfg.micro_steps(1)
        return PipelinedModel(model, stage, self.stage_index, ranges)

    def stage_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[tuple, dict[str, torch.Tensor]]:
        """What this stage's forward takes besides the hidden states: ids (first), labels (last)."""
        args = (batch["input_ids"],) if self.is_first else ()
        kwargs = {"position_ids": batch["position_ids"]}
        if "attention_mask" in batch:
            kwargs["attention_mask"] = batch["attention_mask"]
        if self.is_last:
            kwargs["labels"] = batch["labels"]
        return args, kwargs

    # --- the step's gradients
    def clip_across_stages(self, params: list[torch.Tensor], max_grad_norm: float) -> float:
        """Clip by the global gradient norm of the whole model, each stage holding some of the
        parameters: squared norms summed over the stages. Returns the norm before clipping."""
        # the tied weight's (already summed) gradient is counted once, on the first stage
        counted = [p for p in params if p.grad is not None and not (self.is_last and p is self.tied_param)]
        sq = torch.zeros(1, dtype=torch.float64, device=self.choice.device)
        for p in counted:  # per-tensor norms in the gradient's dtype, as clip_grad_norm_ computes them
            sq += torch.linalg.vector_norm(p.grad.detach()).double() ** 2
        dist.all_reduce(sq)
        norm = float(sq.sqrt())
        if max_grad_norm and max_grad_norm > 0:
            coef = max_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        return norm

    # --- evaluation: a plain forward through the stages, one batch at a time
    def _send_tensor(self, t: torch.Tensor, dst: int) -> None:
        header = torch.tensor([t.dim(), *t.shape, _DTYPES.index(t.dtype)], dtype=torch.int64, device=t.device)
        dist.send(torch.tensor([header.numel()], dtype=torch.int64, device=t.device), dst)
        dist.send(header, dst)
        dist.send(t.contiguous(), dst)

    def _recv_tensor(self, src: int, device: torch.device) -> torch.Tensor:
        n = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(n, src)
        header = torch.zeros(int(n), dtype=torch.int64, device=device)
        dist.recv(header, src)
        ndim = int(header[0])
        shape = [int(x) for x in header[1:1 + ndim]]
        t = torch.empty(shape, dtype=_DTYPES[int(header[1 + ndim])], device=device)
        dist.recv(t, src)
        return t

    @torch.no_grad()
    def evaluate(self, model, data, choice: DeviceChoice, batch_size: int = 8) -> float:
        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=choice.device)
        for i in range(0, len(data), batch_size):
            rows = list(range(i, min(i + batch_size, len(data))))
            raw = data.batch(rows)
            batch = stack_microbatches([raw], self.cfg.seq_len, choice.device)
            _, kwargs = self.stage_inputs(batch)
            p = self.num_stages
            for vs, chunk in zip(self.chunk_stages, self.chunks):  # virtual stage vs follows vs - 1 on rank r - 1
                x = batch["input_ids"] if vs == 0 else self._recv_tensor((self.stage_index - 1) % p, choice.device)
                with autocast(choice):
                    out = chunk(x, **kwargs)
                if chunk.last:
                    total[0] += float(out)
                else:
                    self._send_tensor(out, (self.stage_index + 1) % p)
            total[1] += raw["n_label_tokens"]
        dist.broadcast(total, src=self.num_stages - 1)
        model.train(was_training)
        return float(total[0] / total[1])

    # --- saving
    def _owned_state(self, model: PipelinedModel) -> dict[str, torch.Tensor]:
        lm = model.lm
        if hasattr(lm, "peft_config"):  # the adapter file's own keys (adapter name stripped), this stage's only
            from peft import get_peft_model_state_dict  # deferred: peft imports half of transformers

            return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(lm).items()}
        return {k: v.detach().cpu() for k, v in lm.state_dict().items()}

    def save_model(self, model, path: Path, tokenizer=None) -> None:
        """Every stage sends its part to rank 0, which writes one adapter (LoRA) or one full model,
        loadable with from_pretrained like the single-device one."""
        part = self._owned_state(model)
        every: list[Any] = [None] * self.world_size if self.is_main else None
        dist.gather_object(part, every, dst=0)
        if self.is_main:
            merged: dict[str, torch.Tensor] = {}
            for p in every:
                merged.update(p)
            lm = model.lm
            if hasattr(lm, "peft_config"):
                # What PeftModel.save_pretrained writes: the adapter config and adapter_model.safetensors.
                from safetensors.torch import save_file  # deferred: only saving a pipeline adapter needs it

                config = copy.deepcopy(lm.peft_config["default"])
                config.inference_mode = True
                Path(path).mkdir(parents=True, exist_ok=True)
                config.save_pretrained(str(path))
                save_file(merged, str(Path(path) / "adapter_model.safetensors"), metadata={"format": "pt"})
            else:
                causal = model.causal_lm
                if getattr(causal.config, "tie_word_embeddings", False):  # the head is the embedding: saved once
                    for k in [k for k in merged if k.endswith("lm_head.weight")]:
                        merged.pop(k)
                causal.save_pretrained(path, state_dict=merged)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
        self.barrier()

    def _state_file(self, path: Path) -> Path:
        return Path(path) / f"training_state.stage{self.stage_index}.pt"

    def save_training_state(self, model, optimizer, path: Path) -> None:
        """Each stage writes its own trained weights and optimizer state (no gathering)."""
        torch.save({"model": trained_weights(model.full), "optimizer": optimizer.state_dict(),
                    "stage_layers": [len(r) for r in model.ranges]}, self._state_file(path))

    def load_training_state(self, model, optimizer, path: Path) -> None:
        state = load_tensors(self._state_file(path))  # tensors and plain data only: a crafted file is refused
        if state["stage_layers"] != [len(r) for r in model.ranges]:
            raise RuntimeError(f"{path}: written with stage layers {state['stage_layers']}, resuming with "
                               f"{[len(r) for r in model.ranges]}")
        load_trained_weights(model.full, state["model"], path)
        optimizer.load_state_dict(state["optimizer"])
