"""A cheaper dropout for LoRA inputs: four masks from every 64-bit random number.

LoRA applies dropout to the input of each adapted projection (seven per layer here), and on a
CPU the random numbers are the expensive part: `torch.nn.functional.dropout` draws one for
every element (`bernoulli_`, ~14% of a tiny-model LoRA step, as much as attention). Dropout only
needs a coin with probability p, and 16 random bits are plenty for that: one 64-bit draw gives
four coins. The keep probability becomes 1 - round(p * 65536) / 65536 (0.05 -> 0.0500031) and the
survivors are scaled by its inverse, so the expected activation is unchanged, as in ordinary
inverted dropout. It uses torch's generator, so `torch.manual_seed` makes it reproducible.

TrainConfig.fast_dropout (default on) swaps it in for peft's `nn.Dropout` modules; off gives
peft's own dropout. Inside a compiled block it is the stock dropout: the compiler draws its random
numbers in the kernel that uses them.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

LEVELS = 65536  # 16-bit coins


class Dropout16(torch.nn.Module):
    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.threshold = round(p * LEVELS)  # drop when the 16-bit coin (0..65535) is below this
        self.scale = LEVELS / (LEVELS - self.threshold)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.threshold == 0:
            return x
        if torch.compiler.is_compiling():
            # a compiled block draws its random numbers in the generated kernel (fused with their use), so the
            # eager saving does not apply, and Dynamo cannot trace the in-place draw below: the stock dropout
            return torch.nn.functional.dropout(x, self.p, True)
        local = x.to_local() if isinstance(x, DTensor) else x
        n = local.numel()
        words = torch.empty((n + 3) // 4, dtype=torch.int64, device=local.device).random_(-2**63, 2**63 - 1)
        coins = words.view(torch.int16)[:n].view(local.shape)  # signed: -32768..32767, uniform
        keep = (coins >= self.threshold - LEVELS // 2).to(local.dtype) * self.scale
        if isinstance(x, DTensor):
            # tensor parallelism hands a LoRA factor the block input as a DTensor: the mask takes its layout.
            # Every rank draws the same coins (the same seed, the same calls), so a replicated input keeps
            # one mask on all ranks, as its values must stay equal
            keep = DTensor.from_local(keep, x.device_mesh, x.placements, run_check=False)
        return x * keep

    def extra_repr(self) -> str:
        return f"p={self.p} (effective {self.threshold / LEVELS:.7f})"


def replace_lora_dropout(model: torch.nn.Module) -> int:
    """Swap peft's LoRA dropout modules (torch.nn.Dropout with p > 0) for Dropout16; returns how many."""
    swapped = 0
    for module in model.modules():
        holder = getattr(module, "lora_dropout", None)
        if isinstance(holder, torch.nn.ModuleDict):
            for name, drop in list(holder.items()):
                if isinstance(drop, torch.nn.Dropout) and drop.p > 0:
                    holder[name] = Dropout16(drop.p)
                    swapped += 1
    return swapped
