"""2-D parallelism: tensor parallelism inside a group of ranks, FSDP across the groups (FSDP x TP).

What changes against `tp` and `fsdp`: the ranks form a 2-D device mesh, (dp, tp) = (world / tp_size,
tp_size). Along "tp" each decoder layer is split as `tp` splits it (strategies.tp.apply_tp_plan: the
ranks of one tp group work on the same rows); along "dp" every weight, including each tp slice, is
sharded by `fully_shard` as `fsdp` does (strategies.fsdp.apply_fsdp), and the dp groups see different rows. So a
rank holds about 1/world of each projection and 1/dp of the rest; activations are summed inside a tp group
(all-reduce) and gradients reduce-scattered across the dp groups. On GPU clusters tp stays inside a node (its
all-reduces sit on the critical path of every layer) and dp spans nodes.

The strategy is the composition of those two steps, in the order distlab.strategies.base.parallelize applies
them (`split`, then `shard`), and of the two strategies' functions: tp's per-tensor optimizer, clipping and
gathered save (DTensors on two meshes), fsdp's no_sync and sharded state. The loop's token counts and loss are
summed over the dp group only: the tp ranks of a group hold the same rows. LoRA as `tp` splits it;
`sequence_parallel` as `tp` (inside each tp group); no periodic checkpoints yet (as `tp`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from distlab.device import DeviceChoice
from distlab.strategies import fsdp, tp
from distlab.strategies.base import DistributedStrategy, save_consolidated

DEFAULT_TP_SIZE = 2


class FSDPxTPStrategy(DistributedStrategy):
    name = "fsdp_tp"
    shards_checkpoint = True  # fsdp's sharded state (written when a stop signal saves one)
    loads_shards = True  # prepare_run builds it weightless; each rank reads the block both cuts leave it

    def __init__(self) -> None:
        super().__init__()
        self.cfg = None
        self.mesh = None

    def setup(self, cfg) -> None:
        tp.refuse_periodic_checkpoints(self.name, cfg)
        super().setup(cfg)
        self.cfg = cfg
        tp_size = cfg.tp_size or DEFAULT_TP_SIZE
        if self.world_size % tp_size or self.world_size == tp_size:
            raise ValueError(f"strategy 'fsdp_tp' needs the world size ({self.world_size}) a multiple of "
                             f"tp_size ({tp_size}) with at least two tp groups; use 'tp' for one group")
        device_type = "cuda" if self.backend == "nccl" else "cpu"
        self.mesh = init_device_mesh(device_type, (self.world_size // tp_size, tp_size),
                                     mesh_dim_names=("dp", "tp"))

    @property
    def data_parallel_size(self) -> int:
        return self.mesh["dp"].size()

    @property
    def data_parallel_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    # --- the two cuts: tp's plan along "tp", then fsdp's fully_shard of every slice along "dp"
    def split(self, model: torch.nn.Module, cfg) -> None:
        tp.apply_tp_plan(model, self.mesh["tp"], cfg.sequence_parallel)

    def shard(self, model: torch.nn.Module, choice: DeviceChoice, cfg) -> None:
        fsdp.apply_fsdp(model, self.mesh["dp"], choice, cfg.fsdp_reshard_after_forward)

    def sync_context(self, model, sync: bool):
        return fsdp.gradient_sync(model, sync)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.mesh["dp"].get_group())  # one copy of each row's counts
        return tensor

    # --- DTensors on two meshes: tp's per-tensor optimizer and its full-tensor gradient norm
    def make_optimizer(self, model, lr: float, weight_decay: float, fused: bool = False):
        return tp.per_tensor_adamw(model, lr, weight_decay)

    def optimizer_step(self, model, optimizer, scheduler, max_grad_norm: float) -> float:
        return tp.clip_and_step(model, optimizer, scheduler, max_grad_norm, self.meter)

    # --- saving: the model gathered as tp gathers it, training state sharded as fsdp writes it
    def save_model(self, model: torch.nn.Module, path: Path, tokenizer=None) -> None:
        full = tp.full_state(model)  # collective: every rank gathers
        if self.is_main:
            save_consolidated(model, full, path, tokenizer)
        self.barrier()

    def save_training_state(self, model, optimizer, path: Path) -> None:
        fsdp.save_sharded_state(model, optimizer, path, lora=bool(self.cfg and self.cfg.lora))

    def load_training_state(self, model, optimizer, path: Path) -> None:
        fsdp.load_sharded_state(model, optimizer, path, lora=bool(self.cfg and self.cfg.lora))
