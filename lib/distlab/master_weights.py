"""fp32 master weights for a bf16 model (`master_weights: true` with `dtype: bf16`): the optimizer steps an fp32
copy of every trained weight, and the bf16 weights the model computes with are that copy rounded.

Why: bf16 keeps 8 significant bits, so the gap between neighbouring bf16 values is 2^-7 of a weight (at the
bottom of its binade, 2^-8 at the top). An update under half that gap, 2^-9 to 2^-8 of the weight, rounds
straight back to the weight: a weight of 1.0 stepped by lr=1e-3 stays 1.0 for ever. Late in a cosine schedule,
or with a small learning rate from the start, most of AdamW's updates are that small, and pure-bf16 training
silently stops learning. An fp32 master keeps every update (fp32 has 24 bits), and once the small updates add up
to more than half a gap the bf16 weight moves too. AdamW's moments live on the masters, so they are fp32 as well.

Cost: 4 more bytes per trained weight (the master; its fp32 gradient exists only inside `step`, and is freed by
`zero_grad`). A weight that is fp32 already (an adapter PEFT made in fp32) is its own master: no copy.

How it is used: the strategies' `make_optimizer` builds it when the config says `master_weights: true`
(`make_master_weight_optimizer`, with the parameter groups AdamW would get), and the loop uses it as any
optimizer: clip the model's bf16 gradients (torch.nn.utils.clip_grad_norm_), `step()`, the LR scheduler's
`step()` (a LambdaLR reads and writes `param_groups`, which are the inner AdamW's), `zero_grad()`; a checkpoint
saves `state_dict()` (masters included: a resumed run continues exactly) and a resume `load_state_dict()`s it.

    opt = MasterWeightOptimizer(groups, torch.optim.AdamW, lr=2e-4)   # groups: bf16 parameters
    ...backward...; clip_grad_norm_(model.parameters(), 1.0); opt.step(); scheduler.step(); opt.zero_grad()

A step adds no host synchronisation: gradients are cast and weights copied back on the device, and nothing is
read to the host. Only strategies whose optimizer is a plain torch optimizer over the local parameters can use it
(single and ddp; distlab.config checks); DeepSpeed keeps fp32 masters itself, and FSDP2 keeps fp32 shards when the
weights are loaded in fp32 (dtype bf16-autocast) and computes in bf16 through its mixed-precision policy.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from distlab import compat

# What a checkpoint's optimizer state holds the masters under, beside torch's own "state" and "param_groups":
# {index: fp32 tensor}, indexed as torch indexes "state" (parameters in group order), for the weights that have a
# separate master. A plain torch optimizer's load_state_dict ignores it.
MASTERS_KEY = "master_weights"


class MasterWeightOptimizer(torch.optim.Optimizer):
    """An inner torch optimizer (AdamW) stepping fp32 masters of low-precision parameters.

    `param_groups` and `state` are the inner optimizer's (the masters' groups, the masters' moments), so an
    LR scheduler sets the learning rate the inner optimizer uses. The model's parameters keep their gradients;
    `step` casts them onto the masters, steps the inner optimizer, and copies the masters back into the
    model's parameters."""

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 **optimizer_kwargs: Any) -> None:
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (model parameter, its master), in group order
        master_groups = []
        for group in groups:
            masters = []
            for p in group["params"]:
                # A weight that is fp32 already is stepped in place: a copy would only cost memory.
                master = p if p.dtype == torch.float32 else p.detach().to(torch.float32, copy=True)
                self._pairs.append((p, master))
                masters.append(master)
            master_groups.append({**group, "params": masters})
        # Optimizer.__init__ sets up the step hooks an LR scheduler and profilers rely on; its param_groups and
        # state are then replaced by the inner optimizer's own objects, so that both see every change.
        super().__init__([{"params": [m for _, m in self._pairs]}], {})
        self.inner = optimizer_class(master_groups, **optimizer_kwargs)
        self._share_inner()
        # the weights with a separate master: their indices as torch's state_dict numbers them, the weights, the masters
        self._low_index = [i for i, (p, m) in enumerate(self._pairs) if m is not p]
        self._low_params = [self._pairs[i][0] for i in self._low_index]
        self._masters = [self._pairs[i][1] for i in self._low_index]
        # The masters follow the weights until the first step or a load: whatever changes the weights after the
        # optimizer is built (DDP's broadcast from rank 0, a checkpoint's weights loaded before its optimizer
        # state) is what training starts from.
        self._masters_current = False

    def _share_inner(self) -> None:
        # the inner optimizer's load_state_dict rebinds its lists: point at them again after one
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.defaults = self.inner.defaults

    @property
    def master_params(self) -> list[torch.Tensor]:
        """The separate fp32 masters (not the fp32 weights that are their own): the 4 bytes a weight this costs."""
        return list(self._masters)

    @torch.no_grad()
    def _copy(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        if dst:
            compat.foreach_copy_(dst, src)  # one batched cast-and-copy on the device, no host round trip

    def _ensure_masters(self) -> None:
        if not self._masters_current:
            self._copy(self._masters, self._low_params)
            self._masters_current = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_masters()
        for p, m in zip(self._low_params, self._masters):
            # A weight without a gradient this step keeps none on its master either, so AdamW skips it
            # (moments and weight decay untouched), as it would the weight itself.
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
        self.inner.step()
        self._copy(self._low_params, self._masters)  # round the masters into the weights the model computes with
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, m in self._pairs:
            for t in (p, m) if m is not p else (p,):
                if t.grad is None:
                    continue
                if set_to_none:
                    t.grad = None
                else:
                    t.grad.detach_()
                    t.grad.zero_()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not hasattr(self, "inner"):  # Optimizer.__init__ adding its throwaway group
            return super().add_param_group(param_group)
        raise NotImplementedError("MasterWeightOptimizer: give every parameter group when building it")

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict (moments, step counts, groups) and the masters under MASTERS_KEY."""
        state = self.inner.state_dict()
        # before the first step the masters are the weights as they are now (and go on following them)
        masters = self._masters if self._masters_current else [p.detach().float() for p in self._low_params]
        state[MASTERS_KEY] = dict(zip(self._low_index, masters))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from `state_dict()`. One without masters (a plain optimizer's: a run resumed with
        master_weights switched on) keeps its moments, and the masters start from the weights as loaded."""
        state_dict = dict(state_dict)
        saved = state_dict.pop(MASTERS_KEY, None)
        if saved is not None:
            expected = dict(zip(self._low_index, self._masters))
            if set(saved) != set(expected) or any(saved[i].shape != m.shape for i, m in expected.items()):
                raise ValueError(f"MasterWeightOptimizer: the saved state holds masters for parameters "
                                 f"{sorted(saved)[:5]}..., not the {len(expected)} low-precision ones of this model")
        self.inner.load_state_dict(state_dict)
        self._share_inner()
        if saved is None:
            self._masters_current = False
            return
        with torch.no_grad():
            for i, m in expected.items():
                m.copy_(saved[i])
        self._masters_current = True


def make_master_weight_optimizer(param_groups, lr: float, **adamw_kwargs: Any) -> MasterWeightOptimizer:
    """torch AdamW over fp32 masters of `param_groups` (as Strategy.make_optimizer groups the trained weights:
    decayed matrices, undecayed vectors). `adamw_kwargs`: betas, eps, fused, ... as torch.optim.AdamW takes them."""
    return MasterWeightOptimizer(param_groups, torch.optim.AdamW, lr=lr, **adamw_kwargs)
