"""2-D parallelism: tensor parallelism inside a group of ranks, FSDP across the groups (FSDP x TP).

What changes against `tp` and `fsdp`: the ranks form a 2-D device mesh, (dp, tp) = (world / tp_size,
tp_size). Along "tp" each decoder layer is split as `tp` splits it (strategies.tp.apply_tp_plan: the
ranks of one tp group work on the same rows); along "dp" every weight, including each tp slice, is
sharded by `fully_shard` as `fsdp` does, and the dp groups see different rows. So a rank holds about
1/world of each projection and 1/dp of the rest; activations are summed inside a tp group (all-reduce)
and gradients reduce-scattered across the dp groups. On GPU clusters tp stays inside a node (its
all-reduces sit on the critical path of every layer) and dp spans nodes.

The loop's token counts and loss are summed over the dp group only: the tp ranks of a group hold the
same rows. LoRA as `tp` splits it; `sequence_parallel` as `tp` (inside each tp group); no periodic
checkpoints yet (as `tp`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from distlab.device import DeviceChoice
from distlab.strategies.base import DistributedStrategy
from distlab.strategies.fsdp import FSDPStrategy
from distlab.strategies.split import decoder_layers
from distlab.strategies.tp import TPStrategy, apply_tp_plan

DEFAULT_TP_SIZE = 2


class FSDPxTPStrategy(FSDPStrategy):
    name = "fsdp_tp"

    def setup(self, cfg) -> None:
        TPStrategy.refuse_what_tp_cannot_do(self.name, cfg)
        DistributedStrategy.setup(self, cfg)
        self.cfg = cfg
        tp = cfg.tp_size or DEFAULT_TP_SIZE
        if self.world_size % tp or self.world_size == tp:
            raise ValueError(f"strategy 'fsdp_tp' needs the world size ({self.world_size}) a multiple of "
                             f"tp_size ({tp}) with at least two tp groups; use 'tp' for one group")
        device_type = "cuda" if self.backend == "nccl" else "cpu"
        self.mesh = init_device_mesh(device_type, (self.world_size // tp, tp), mesh_dim_names=("dp", "tp"))

    @property
    def data_parallel_size(self) -> int:
        return self.mesh["dp"].size()

    @property
    def data_parallel_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    def wrap_model(self, model: torch.nn.Module, choice: DeviceChoice) -> torch.nn.Module:
        mp = self.mixed_precision(choice)

        def shard(model):  # first the tp slices, then FSDP shards each slice over dp
            apply_tp_plan(model, self.mesh["tp"], self.cfg.sequence_parallel)
            for layer in decoder_layers(model):
                fully_shard(layer, mesh=self.mesh["dp"], reshard_after_forward=self.cfg.fsdp_reshard_after_forward,
                            mp_policy=mp)
            fully_shard(model, mesh=self.mesh["dp"], mp_policy=mp)

        # each rank reads the block of each weight that both cuts leave it
        return self.shard_then_fill(model, choice, shard)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.mesh["dp"].get_group())  # one copy of each row's counts
        return tensor

    # DTensors on two meshes: the per-tensor optimizer and the full-tensor gradient norm of `tp`
    make_optimizer = TPStrategy.make_optimizer
    optimizer_step = TPStrategy.optimizer_step
    save_model = TPStrategy.save_model
