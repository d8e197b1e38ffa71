"""Which strategy to run on a set of GPUs (chapter 03): the LAN-cluster guide's decision tree.

`recommend` walks the decision tree with the planner's numbers (memory per rank from distlab.planning.plan
and .load, bytes on the wire from distlab.planning.wire_bytes), in two parts: `decide` makes the choice and
returns it as data (a `Decision`: every option weighed, and the branch that decided), and `explain` renders
that decision as the prose the chapter prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import pandas as pd

from distlab.layer_split import tp_degree_problem
from distlab.planning.load import LoadPeak, plan_load
from distlab.planning.plan import plan_memory
from distlab.planning.shapes import parameter_count
from distlab.planning.wire_bytes import communication_bytes
from distlab.results.schema import MemoryBreakdown

GIB = 1024**3
FAST_LINK_GBIT = 100.0  # NVLink, InfiniBand: fast enough for tensor parallelism's per-layer all-reduces


def _gib(nbytes: float) -> float:
    return nbytes / GIB


def _bits(weight_bytes: float) -> str:
    return {4: "fp32", 2: "bf16", 1: "8-bit", 0.5: "4-bit"}.get(weight_bytes, f"{weight_bytes}-byte")


# ----------------------------------------------------------------------------- the decision, as data

@dataclass
class Option:
    """One setup the decision tree weighed."""

    strategy: str
    weight_bytes: float  # of the base weights
    offload_optimizer: bool
    plan: MemoryBreakdown  # per rank, in a step
    load: LoadPeak  # per rank, while the model loads (distlab.planning.load)
    comm_bytes: float  # each rank sends per step (weights travel in at least bf16)
    comm_s: float  # at the link speed; nan without one
    fits_every_gpu: bool  # its peak (the larger of loading and a step) fits the smallest usable memory

    @property
    def peak(self) -> float:
        """Bytes per rank at the worst moment of the run: loading or a step, whichever needs more."""
        return max(self.plan.total, self.load.device)

    @property
    def setup(self) -> str:
        return f"{self.strategy}, {_bits(self.weight_bytes)} weights" + \
            (", optimizer offload" if self.offload_optimizer else "")


# The branches of the tree that end it, in the order it tries them.
OUTCOMES = {
    "replica_fits": "1. one replica fits every GPU: DDP",
    "zero2_fits": "2. sharding gradients + optimizer state is enough: ZeRO-2",
    "quantise_for_link": "3. sharding would fit, but its all-gathers are too slow for the link: quantise, DDP",
    "sharded_fits": "3. sharding everything fits: FSDP or ZeRO-3, whichever needs less",
    "tp_fits": "3. sharding alone does not fit, the link is fast: tensor parallelism in pairs, FSDP across them",
    "quantise": "4. nothing sharded fits, quantised base weights do: DDP",
    "quantise_and_shard": "4. no quantised replica fits, a 4-bit base sharded by FSDP does: FSDP + QLoRA",
    "offload": "4. ZeRO-3 with the optimizer state offloaded to the CPU fits",
    "nothing_fits": "4. nothing fits",
}


@dataclass
class Decision:
    """What `decide` chose and why: the run and hardware it judged, every option it weighed (in
    order), the branch that ended the tree (a key of OUTCOMES) and the option chosen there."""

    model_name: str
    parameters: int
    lora_r: int | None
    micro_batch: int
    seq_len: int
    activation_checkpointing: bool
    devices: list[str]
    capacity_gib: list[float]
    usable_gib: list[float]  # capacity minus the reserve
    reserve_gib: float
    link_gbit: float | None
    max_comm_s: float
    weight_bytes: float  # asked for
    options: list[Option]
    outcome: str
    chosen: Option | None
    sharded: str | None = None  # "fsdp" or "zero3", the smaller, once the tree got that far
    sharded_comm_bytes: float = 0.0  # FSDP's volume per step at the asked-for weight bytes

    @property
    def smallest_usable(self) -> float:
        return min(self.usable_gib)

    def tried(self, strategy: str, weight_bytes: float | None = None) -> Option | None:
        """The first option weighed with `strategy` (at `weight_bytes`, any when None), or None if the tree
        stopped before it."""
        return next((o for o in self.options if o.strategy == strategy
                     and (weight_bytes is None or o.weight_bytes == weight_bytes)), None)

    def option(self, strategy: str, weight_bytes: float | None = None, offload: bool = False) -> Option:
        wb = self.weight_bytes if weight_bytes is None else weight_bytes
        return next(o for o in self.options
                    if (o.strategy, o.weight_bytes, o.offload_optimizer) == (strategy, wb, offload))


def decide(model_config, devices: Sequence[Mapping[str, Any]], *, lora_r: int | None = 16, lora_targets=None,
           weight_bytes: float = 2, seq_len: int = 2048, micro_batch: int = 1, activation_checkpointing: bool = True,
           optimizer: str = "adamw", reserve_gib: float = 1.5, link_gbit: float | None = 1.0,
           max_comm_s: float = 10.0, model_name: str = "the model", shard_quantised: bool = True) -> Decision:
    """The LAN-cluster guide's decision tree on the planner's numbers (see `recommend`). `shard_quantised`:
    whether a quantised base may be sharded (FSDP + QLoRA); False gives the tree with one replica per GPU
    for quantised weights, as it stood before."""
    if not devices:
        raise ValueError("no devices")
    n = len(devices)
    capacity = [float(d["memory_gib"]) for d in devices]
    usable = [max(c - reserve_gib, 0.0) for c in capacity]
    smallest = min(usable)
    targets = list(lora_targets) if lora_targets else None
    options: list[Option] = []

    def consider(strategy: str, wb: float, offload: bool = False) -> Option:
        # bitsandbytes' 8-bit AdamW updates whole tensors: a sharded strategy keeps torch's AdamW
        opt = optimizer if strategy in ("single", "ddp") else "adamw"
        settings = dict(weight_bytes=wb, lora_r=lora_r, lora_targets=targets, micro_batch=micro_batch,
                        seq_len=seq_len, activation_checkpointing=activation_checkpointing, activation_bytes=2,
                        optimizer=opt, offload_optimizer=offload)
        plan = plan_memory(model_config, strategy=strategy, world_size=n, **settings)
        load = plan_load(model_config, strategy=strategy, world_size=n, **settings)
        # weights travel in at least bf16, except a 4-bit base under FSDP: it all-gathers the packed bytes
        travel = wb if (strategy == "fsdp" and wb < 2) else max(wb, 2)
        comm = communication_bytes(model_config, strategy, n, lora_r=lora_r, lora_targets=targets,
                                   weight_bytes=travel, grad_bytes=4, tokens=micro_batch * seq_len)
        option = Option(strategy, wb, offload, plan, load, comm,
                        comm / (link_gbit * 1e9 / 8) if link_gbit else float("nan"),
                        _gib(max(plan.total, load.device)) <= smallest)
        options.append(option)
        return option

    def decision(outcome: str, chosen: Option | None, **more) -> Decision:
        return Decision(model_name, parameter_count(model_config), lora_r, micro_batch, seq_len,
                        activation_checkpointing, [str(d.get("name", f"gpu{i}")) for i, d in enumerate(devices)],
                        capacity, usable, reserve_gib, link_gbit, max_comm_s, weight_bytes, options, outcome, chosen,
                        **more)

    # 1. does one replica fit every GPU?
    replica = consider("ddp", weight_bytes)
    if all(_gib(replica.peak) <= u for u in usable):
        return decision("replica_fits", replica)
    if weight_bytes < 2:  # a quantised base was asked for and its replica does not fit: ZeRO cannot shard it
        return quantised_fallback(consider, decision, lora_r, weight_bytes, shard_quantised)
    # 2. shard the gradients and optimizer state (ZeRO-2)
    zero2 = consider("zero2", weight_bytes)
    if zero2.fits_every_gpu:
        return decision("zero2_fits", zero2)
    # 3. shard everything. FSDP2 and ZeRO-3 shard the same state; they differ in what stays gathered
    # (FSDP2's root keeps the embedding and LM head from forward to backward, ZeRO-3 keeps tensors
    # under 100k elements whole).
    fsdp, zero3 = consider("fsdp", weight_bytes), consider("zero3", weight_bytes)
    sharded = fsdp if fsdp.peak <= zero3.peak else zero3
    quantised = None  # the first quantisation of the base weights (LoRA only) whose replica fits
    if lora_r and weight_bytes > 0.5:
        for wb in (1, 0.5):
            if wb < weight_bytes:
                q = consider("ddp", wb)
                if q.fits_every_gpu:
                    quantised = q
                    break
    more = dict(sharded=sharded.strategy, sharded_comm_bytes=communication_bytes(
        model_config, "fsdp", n, lora_r=lora_r, lora_targets=targets, weight_bytes=weight_bytes))
    if sharded.fits_every_gpu:
        if link_gbit and fsdp.comm_s > max_comm_s and quantised is not None:
            return decision("quantise_for_link", quantised, **more)
        return decision("sharded_fits", sharded, **more)
    # 3b. on a fast link, tensor parallelism in pairs of GPUs halves what FSDP gathers per layer (and the
    # projections each rank keeps); its per-layer all-reduces of activations need that link
    pairs_fit = n >= 4 and n % 2 == 0 and tp_degree_problem(model_config, 2) is None
    if link_gbit and link_gbit >= FAST_LINK_GBIT and pairs_fit:
        two_d = consider("fsdp_tp", weight_bytes)
        if two_d.fits_every_gpu:
            return decision("tp_fits", two_d, **more)
    # 4. quantise, then shard the quantised base (FSDP + QLoRA), then offload
    if quantised is not None:
        return decision("quantise", quantised, **more)
    if lora_r and shard_quantised:
        q_fsdp = consider("fsdp", 0.5)
        if q_fsdp.fits_every_gpu:
            return decision("quantise_and_shard", q_fsdp, **more)
    offload = consider("zero3", weight_bytes, offload=True)
    if offload.fits_every_gpu:
        return decision("offload", offload, **more)
    return decision("nothing_fits", None, **more)


def quantised_fallback(consider, decision, lora_r, weight_bytes: float, shard_quantised: bool) -> Decision:
    """The tree's end for a quantised base (8- or 4-bit asked for) whose replica does not fit: a 4-bit replica
    (from 8-bit), then the 4-bit base sharded by FSDP (bitsandbytes' int8 weights do not shard), else nothing."""
    if lora_r and weight_bytes > 0.5:
        q = consider("ddp", 0.5)
        if q.fits_every_gpu:
            return decision("quantise", q)
    if lora_r and shard_quantised:
        q = consider("fsdp", 0.5)
        if q.fits_every_gpu:
            return decision("quantise_and_shard", q)
    return decision("nothing_fits", None)


# ----------------------------------------------------------------------------- the decision, as prose

def explain(d: Decision) -> list[str]:
    """The decision as the chapter prints it: one line per question the tree asked."""
    n, smallest, link = len(d.devices), d.smallest_usable, d.link_gbit
    what = f"{d.model_name} ({d.parameters / 1e9:.2f}B parameters, " + \
        (f"LoRA r={d.lora_r}" if d.lora_r else "full fine-tuning") + \
        f", micro-batch {d.micro_batch} x {d.seq_len} tokens" + \
        (", activation checkpointing" if d.activation_checkpointing else "") + ")"
    lines = [f"Model: {what}. Usable memory per GPU (capacity - {d.reserve_gib} GiB reserve): " +
             ", ".join(f"{nm} {u:.1f} GiB" for nm, u in zip(d.devices, d.usable_gib)) + "."]

    replica = d.option("ddp").plan
    lines.append(f"1. Does the model fit one GPU? A full replica in {_bits(d.weight_bytes)} needs "
                 f"{_gib(replica.total):.2f} GiB (weights {_gib(replica.weights + replica.adapter_weights):.2f}, "
                 f"gradients + optimizer {_gib(replica.gradients + replica.optimizer_state):.2f}, activations "
                 f"{_gib(replica.activations):.2f}, buffers {_gib(replica.buffers):.2f}).")
    if d.outcome == "replica_fits":
        ddp = d.option("ddp")
        lines.append(f"   YES on every GPU (smallest usable {smallest:.1f} GiB) -> DDP on all {n} GPUs: each holds a "
                     f"replica and all-reduces {ddp.comm_bytes / 1e6:.0f} MB of gradients per step "
                     f"({ddp.comm_s:.2f} s at {link} Gbit/s).")
        if len(set(d.capacity_gib)) > 1:
            lines.append(f"   The GPUs differ ({' / '.join(f'{c:g} GB' for c in d.capacity_gib)}): DDP runs in "
                         "lock-step, so the slowest GPU sets the pace and the smallest one the micro-batch (every "
                         "rank runs the same); expect less than a linear speed-up.")
        return lines
    fits = [nm for nm, u in zip(d.devices, d.usable_gib) if _gib(d.option("ddp").peak) <= u]
    lines.append("   Only on " + ", ".join(fits) + ": DDP needs it on every GPU." if fits
                 else "   NO: not even on the largest GPU.")

    if d.weight_bytes < 2:  # a quantised base asked for: ZeRO does not shard it (quantised_fallback)
        return lines + _quantised_fallback_lines(d)
    lines.append(f"2. Is total VRAM enough? {sum(d.usable_gib):.1f} GiB usable over {n} GPUs vs "
                 f"{_gib(replica.state):.2f} GiB of weights, gradients and optimizer state to divide (plus "
                 "activations on every GPU).")
    if d.outcome == "zero2_fits":
        lines.append(f"   ZeRO-2 (weights replicated, gradients + optimizer sharded) needs "
                     f"{_needs(d.chosen)} per GPU <= {smallest:.1f} -> ZeRO-2, with DDP's "
                     "communication volume.")
        return lines

    fsdp, zero3 = d.option("fsdp"), d.option("zero3")
    sharded = fsdp if d.sharded == "fsdp" else zero3
    if d.outcome in ("quantise_for_link", "sharded_fits"):
        lines.append(f"   YES: FSDP / ZeRO-3 give each GPU 1/{n} of everything: FSDP {_needs(fsdp)}, "
                     f"ZeRO-3 {_needs(zero3)} per GPU (incl. gather buffers) <= {smallest:.1f} GiB "
                     "on the smallest.")
        if d.outcome == "quantise_for_link":
            q = d.chosen
            lines.append("3. But sharding all-gathers the weights twice per step: "
                         f"{d.sharded_comm_bytes / 1e9:.1f} GB, {fsdp.comm_s:.0f} s per step at {link} Gbit/s "
                         f"(limit {d.max_comm_s:g} s). With "
                         f"{_bits(q.weight_bytes)} base weights a replica needs {_needs(q)} and fits "
                         "every GPU: quantise and use DDP, which only all-reduces the adapters' gradients "
                         f"({q.comm_s:.2f} s per step).")
        else:
            lines.append(f"3. Communication: {fsdp.comm_s:.1f} s per step at {link} Gbit/s for the all-gathers -> "
                         f"{'FSDP' if d.sharded == 'fsdp' else 'DeepSpeed ZeRO-3'}, the smaller of the two here.")
        return lines
    lines.append(f"   NO: even sharded evenly, each GPU would need {_needs(sharded)} "
                 f"({'FSDP' if d.sharded == 'fsdp' else 'ZeRO-3'}) > {smallest:.1f} GiB.")

    tried_tp = d.tried("fsdp_tp")
    if d.outcome == "tp_fits":
        lines.append(f"3. The link is fast ({link:g} Gbit/s): tensor parallelism in pairs of GPUs, FSDP across the "
                     f"{n // 2} pairs (fsdp_tp), needs {_needs(d.chosen)} per GPU <= {smallest:.1f}: "
                     "each GPU gathers half a layer, not a whole one, and keeps only its heads' and FFN slice's "
                     f"activations. With the activation all-reduces of every layer and micro-batch it sends "
                     f"{d.chosen.comm_bytes / 1e9:.1f} GB per step: keep each pair on one node.")
        return lines
    if tried_tp:
        lines.append(f"   FSDP x TP (pairs, fast link) would need {_needs(tried_tp)}: too much "
                     "too.")
    if d.outcome == "quantise":
        q = d.chosen
        lines.append(f"4. Quantise more aggressively: with {_bits(q.weight_bytes)} base weights (LoRA on top) a "
                     f"replica needs {_needs(q)} -> DDP with {_bits(q.weight_bytes)} weights.")
    elif d.outcome == "quantise_and_shard":
        lines.append("4. " + _sharded_4bit_line(d))
    elif d.outcome == "offload":
        lines.append(f"4. Offload the optimizer state to CPU memory (ZeRO-3 + offload_optimizer): "
                     f"{_needs(d.chosen)} per GPU; each step then waits for the CPU update.")
    else:
        tried = [o for o in d.options if o.strategy == "ddp" and o.weight_bytes < d.weight_bytes]
        smallest_replica = f" (a {_bits(tried[-1].weight_bytes)} replica needs {_needs(tried[-1])}" \
            if tried else ""
        sharded_4bit = d.tried("fsdp", 0.5)
        if tried:
            smallest_replica += (f"; a 4-bit base sharded by FSDP needs {_needs(sharded_4bit)})" if sharded_4bit
                                 else ")")
        lines.append(f"4. Nothing fits{smallest_replica}: " + ("use shorter sequences, more GPUs or a smaller model."
                     if tried else "use LoRA with quantised weights, shorter sequences, activation checkpointing, "
                     "more GPUs or a smaller model."))
    return lines


def _needs(o: Option) -> str:
    """What an option needs per GPU: its peak, and when loading needs more than a step, both and why."""
    if o.load.device <= o.plan.total:
        return f"{_gib(o.plan.total):.2f} GiB"
    why = {"whole": "every GPU loads the whole model before it is divided" + (
               ", as bitsandbytes quantises it inside from_pretrained" if o.weight_bytes < 2 else ""),
           "partitioned": "one tensor is gathered whole to be filled", "stage": "it loads its stage whole",
           "slices": "it reads its slices"}[o.load.path]
    return f"{_gib(o.load.device):.2f} GiB while the model loads, {_gib(o.plan.total):.2f} GiB in a step: {why}"


def _sharded_4bit_line(d: Decision) -> str:
    q = d.chosen
    return (f"Shard a 4-bit base (FSDP + QLoRA): FSDP cuts each 4-bit weight's packed values (its per-block "
            f"constants stay whole on every GPU), the adapters, their gradients and optimizer state over "
            f"{len(d.devices)} GPUs: {_needs(q)} per GPU <= {d.smallest_usable:.1f} -> FSDP with "
            f"4-bit weights. Each step all-gathers the packed layers: {q.comm_bytes / 1e9:.2f} GB "
            f"({q.comm_s:.1f} s at {d.link_gbit} Gbit/s).")


def _quantised_fallback_lines(d: Decision) -> list[str]:
    lines = ["2. ZeRO cannot shard bitsandbytes' weights; FSDP shards a 4-bit base only."]
    r = d.tried("ddp", 0.5) if d.weight_bytes > 0.5 else None
    if r:
        lines.append(f"3. A 4-bit replica needs {_needs(r)}" +
                     (" -> DDP with 4-bit weights." if d.outcome == "quantise" else ": too much."))
    if d.outcome == "quantise_and_shard":
        lines.append("4. " + _sharded_4bit_line(d))
    elif d.outcome == "nothing_fits":
        tried = d.tried("fsdp", 0.5)
        lines.append(f"4. Nothing fits: a 4-bit base sharded over {len(d.devices)} GPUs needs "
                     f"{_needs(tried)} per GPU." if tried else
                     "4. Nothing fits with one replica per GPU: shard the 4-bit base (FSDP + QLoRA), use shorter "
                     "sequences, more GPUs or a smaller model.")
    return lines


# ----------------------------------------------------------------------------- both, for the chapter

@dataclass
class Recommendation:
    strategy: str  # ddp | zero2 | fsdp | zero3 | fsdp_tp | none
    weight_bytes: float  # of the base weights in the recommended setup (0.5: 4-bit)
    offload_optimizer: bool
    plan: MemoryBreakdown | None  # per rank, for the recommended setup
    per_device: Any  # DataFrame: device, capacity, usable, predicted, headroom, fits
    candidates: Any  # DataFrame: every setup considered, per-rank GiB, fits, communication per step
    reasoning: list[str]  # explain(decision)
    decision: Decision | None = None

    def __str__(self) -> str:
        head = f"recommended: {self.label}"
        return "\n".join([head, *[f"  {line}" for line in self.reasoning]])

    @property
    def label(self) -> str:
        if self.strategy == "none":
            return "nothing fits"
        bits = {4: "fp32", 2: "bf16", 1: "8-bit", 0.5: "4-bit"}.get(self.weight_bytes, f"{self.weight_bytes} B")
        return f"{self.strategy} with {bits} weights" + (" + optimizer offload" if self.offload_optimizer else "")


def recommend(model_config, devices: Sequence[Mapping[str, Any]], *, lora_r: int | None = 16, lora_targets=None,
              weight_bytes: float = 2, seq_len: int = 2048, micro_batch: int = 1, activation_checkpointing: bool = True,
              optimizer: str = "adamw", reserve_gib: float = 1.5, link_gbit: float | None = 1.0,
              max_comm_s: float = 10.0, model_name: str = "the model",
              shard_quantised: bool = True) -> Recommendation:
    """Which strategy fits `model_config` on these GPUs, with the reasoning: the LAN-cluster guide's
    decision tree, driven by the planner's numbers (`decide`, rendered by `explain`).

    devices: [{"name": ..., "memory_gib": 12}, ...] (distlab.planning.cards: a card's "GB" are GiB). Each GPU
    keeps `reserve_gib` for the CUDA context, kernels' workspaces and fragmentation. Activations are
    planned in bf16 (GPU autocast). The tree:
      1. one replica fits every GPU                -> DDP (lock-step: the smallest/slowest GPU bounds it)
      2. else, only gradients + optimizer too big  -> ZeRO-2 (weights replicated, the rest sharded)
      3. else, total VRAM holds it, sharded evenly -> FSDP / ZeRO-3 (each GPU holds 1/n of everything)
         ... unless every step would all-gather the weights over a slow link (`link_gbit`) for longer
         than `max_comm_s` while quantised weights fit one GPU: then quantise and use DDP
         ... else, on a fast link (>= FAST_LINK_GBIT) and 4+ GPUs: FSDP x TP (TP in pairs) if it fits
      4. else quantise the base weights (8-bit, 4-bit: LoRA only), else shard a 4-bit base with FSDP
         (FSDP + QLoRA; `shard_quantised=False` leaves this out), then offload the optimizer to the CPU.
    A quantised base asked for (`weight_bytes` 1 or 0.5) that does not fit as a replica goes to the same
    fallback: a 4-bit replica, then a 4-bit base under FSDP (ZeRO does not shard bitsandbytes' weights).
    """
    d = decide(model_config, devices, lora_r=lora_r, lora_targets=lora_targets, weight_bytes=weight_bytes,
               seq_len=seq_len, micro_batch=micro_batch, activation_checkpointing=activation_checkpointing,
               optimizer=optimizer, reserve_gib=reserve_gib, link_gbit=link_gbit, max_comm_s=max_comm_s,
               model_name=model_name, shard_quantised=shard_quantised)
    chosen = d.chosen
    per_device = pd.DataFrame({"device": d.devices, "capacity GiB": d.capacity_gib, "usable GiB": d.usable_gib,
                               "predicted GiB": [round(_gib(chosen.peak), 2) if chosen else float("nan")]
                               * len(d.devices)})
    per_device["headroom GiB"] = (per_device["usable GiB"] - per_device["predicted GiB"]).round(2)
    per_device["fits"] = per_device["headroom GiB"] >= 0
    candidates = pd.DataFrame([{
        "setup": o.setup, "per-rank GiB": round(_gib(o.plan.total), 2), "load GiB": round(_gib(o.load.device), 2),
        "weights GiB": round(_gib(o.plan.weights + o.plan.adapter_weights), 2),
        "activations GiB": round(_gib(o.plan.activations), 2), "fits every GPU": o.fits_every_gpu,
        "comm GB/step": round(o.comm_bytes / 1e9, 3), f"comm s/step @ {link_gbit} Gbit/s": round(o.comm_s, 2),
    } for o in d.options])
    if chosen is None:
        return Recommendation("none", weight_bytes, False, None, per_device, candidates, explain(d), d)
    return Recommendation(chosen.strategy, chosen.weight_bytes, chosen.offload_optimizer, chosen.plan, per_device,
                          candidates, explain(d), d)
