"""One pipeline stage for generation: [embeddings] -> decoder layers i..j-1 -> [final norm, LM head].

The stage is built from the model's config as an empty skeleton on the meta device (no memory),
then only the modules it runs are materialised and filled from the checkpoint (distlab.inference.
checkpoint): a stage of half the layers holds half the layer weights, never the whole model (the
Slurm case study loaded everything and offloaded the rest). The forward mirrors transformers' own decoder
forward with a cache (same mask functions, rotary embeddings, layer calls), which is what makes
its greedy tokens identical to `model.generate()`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from distlab.inference.stage_weights import CheckpointError, layer_of, lora_deltas, read_tensors
from distlab.strategies.split import decoder_parts, layer_types


def _qualified(root: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in root.named_modules()}


class InferenceStage(nn.Module):
    """The modules one rank runs; `forward(x, position_ids, attention_mask, cache)` returns hidden
    states on a non-last stage and the last position's fp32 logits on the last."""

    def __init__(self, config, layer_ids, first: bool, last: bool):
        super().__init__()
        from transformers import AutoModelForCausalLM  # deferred: transformers is slow to import

        self.config, self.layer_ids, self.first, self.last = config, list(layer_ids), first, last
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        decoder, head = decoder_parts(skeleton)
        names = _qualified(skeleton)
        self.embed = decoder.embed_tokens if first else None
        self.layers = nn.ModuleList([decoder.layers[i] for i in self.layer_ids])
        self.norm = decoder.norm if last else None
        self.head = head if last else None
        self.tied = head is not None and head.weight is decoder.embed_tokens.weight
        # where each kept module's tensors live in the checkpoint
        self.sources = {"embed": names[id(decoder.embed_tokens)], "norm": names[id(decoder.norm)],
                        "head": names[id(head)]}
        self.sources.update({f"layers.{k}": names[id(decoder.layers[i])] for k, i in enumerate(self.layer_ids)})
        for module in (self.embed, self.norm, self.head, *self.layers):
            if module is not None:
                module.to_empty(device="cpu")
        self.rotary = type(decoder.rotary_emb)(config=config)  # real buffers, computed from the config
        self.kinds = layer_types(config, self.layer_ids)

    def load(self, model_dir: str | Path, adapter_dir: str | Path | None = None, dtype=torch.float32) -> dict:
        """Fill the stage from the checkpoint, reading only its tensors; returns what was read."""
        prefixes = {dst: src + "." for dst, src in self.sources.items()
                    if dst.startswith("layers.") or (dst == "embed" and self.first)
                    or (dst in ("norm", "head") and self.last)}
        if self.last and self.tied:
            prefixes["head"] = self.sources["embed"] + "."
        tensors = read_tensors(model_dir, lambda n: any(n.startswith(p) for p in prefixes.values()))
        if self.last and not self.tied and not any(n.startswith(prefixes["head"]) for n in tensors):
            raise CheckpointError(f"{model_dir}: no LM head tensor under {prefixes['head']}")
        deltas = lora_deltas(adapter_dir, self.layer_ids) if adapter_dir else {}
        read_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        for name, delta in deltas.items():
            if name not in tensors:
                raise CheckpointError(f"{adapter_dir}: adapts {name}, which the checkpoint does not hold")
            tensors[name] = (tensors[name].float() + delta).to(tensors[name].dtype)
        for dst, prefix in prefixes.items():
            module = getattr(self, dst) if not dst.startswith("layers.") else self.layers[int(dst.split(".")[1])]
            state = {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}
            if dst == "head" and self.tied:
                # one stage holding both ends shares the tensor, as the tied model does; else its own copy
                module.weight = self.embed.weight if self.first else nn.Parameter(state["weight"].clone())
                continue
            module.load_state_dict(state, strict=True)
        self.to(dtype)
        self.eval()
        return {"tensors": len(tensors), "read_bytes": read_bytes, "lora_merged": len(deltas),
                "layers": sorted({layer_of(n) for n in tensors if layer_of(n) is not None})}

    def param_bytes(self) -> int:
        seen = {}
        for p in self.parameters():
            seen[p.data_ptr()] = p.numel() * p.element_size()
        return sum(seen.values())

    @torch.no_grad()
    def forward(self, x, position_ids, attention_mask, cache):
        # deferred: transformers is slow to import
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        hidden = self.embed(x) if self.first else x
        masks = {}
        for kind in set(self.kinds):
            make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
            # size the mask on one of this stage's own cache layers (the others stay empty here)
            masks[kind] = make(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                               past_key_values=cache, position_ids=position_ids,
                               layer_idx=self.layer_ids[self.kinds.index(kind)])
        position_embeddings = self.rotary(hidden, position_ids)
        for layer, kind in zip(self.layers, self.kinds):
            out = layer(hidden, attention_mask=masks[kind], position_embeddings=position_embeddings,
                        position_ids=position_ids, past_key_values=cache, use_cache=True)
            hidden = out[0] if isinstance(out, tuple) else out
        if not self.last:
            return hidden
        return self.head(self.norm(hidden)[:, -1:, :]).float()[:, -1]
