"""Cutting a decoder-only LM into pipeline stages, shared by both pipelines and the memory planner.

Stage s holds a contiguous run of decoder layers, plus the token embeddings on the first stage and
the final norm, LM head and loss on the last. Every stage computes the rotary embeddings and the
attention mask itself from the position ids (and the padding mask, when there is one), which
travel with every micro-batch; only the hidden states cross stage boundaries. The parts are
found on any Llama/Qwen2-style transformers model (embed_tokens, layers, norm, rotary_emb, an
output-embedding head), also under a PEFT LoRA wrapper.

Which layers each stage holds is distlab.layer_split's arithmetic (torch-free: the planner uses it too).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distlab.data import IGNORE_INDEX
from distlab.lm_loss import label_loss_sum


def decoder_parts(causal) -> tuple[Any, Any]:
    """(decoder, output head) of a Llama/Qwen2-style causal LM, checked to have what a split needs."""
    decoder = causal.get_decoder()
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(decoder, attr):
            raise TypeError(f"{type(causal).__name__}: its decoder has no `{attr}`; the pipeline split "
                            "supports Llama/Qwen2-style models (embed_tokens, layers, norm, rotary_emb)")
    return decoder, causal.get_output_embeddings()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a distlab CausalLMWithLoss (under a PEFT wrapper or not)."""
    layers = getattr(model.causal_lm.get_decoder(), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model.causal_lm).__name__}: no decoder `.layers` to shard layer by layer")
    return list(layers)


def is_tied(causal) -> bool:
    decoder, head = decoder_parts(causal)
    return head is not None and head.weight is decoder.embed_tokens.weight


def layer_types(config, layer_ids) -> list[str]:
    """Each layer's attention kind ("full_attention" or "sliding_attention")."""
    types = getattr(config, "layer_types", None)
    return [types[i] if types else "full_attention" for i in layer_ids]


class StageMasks:
    """Attention masks (one per attention kind) and rotary embeddings for the micro-batch flowing
    through a stage, built with transformers' own mask functions. Cached on the identity of the
    position-id and mask tensors: the layers of one stage forward all see the same objects."""

    def __init__(self, config, rotary: nn.Module, kinds):
        self.config, self.rotary, self.kinds = config, rotary, sorted(set(kinds) or {"full_attention"})
        self._key: tuple | None = None
        self._value: tuple | None = None

    def __call__(self, hidden, position_ids, attention_mask=None) -> tuple[dict[str, Any], Any]:
        if self._key is not None and self._key[0] is position_ids and self._key[1] is attention_mask:
            return self._value
        # deferred: transformers is slow to import
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        args = dict(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                    past_key_values=None, position_ids=position_ids)
        masks = {kind: create_sliding_window_causal_mask(**args) if kind == "sliding_attention"
                 else create_causal_mask(**args) for kind in self.kinds}
        self._key, self._value = (position_ids, attention_mask), (masks, self.rotary(hidden, position_ids))
        return self._value


def run_layer(layer: nn.Module, hidden, kind: str, masks, position_embeddings, position_ids):
    out = layer(hidden, attention_mask=masks[kind], position_embeddings=position_embeddings,
                position_ids=position_ids, past_key_values=None, use_cache=False)
    return out[0] if isinstance(out, tuple) else out


class StageModule(nn.Module):
    """One pipeline stage of a causal LM: [embeddings] -> layers[i:j] -> [norm, head, summed loss].

    forward(x, position_ids, attention_mask=None, labels=None): x is token ids on the first stage,
    the previous stage's hidden states elsewhere. Non-last stages return hidden states; the last
    returns the summed cross entropy over label positions (a 0-dim fp32 tensor)."""

    def __init__(self, causal, layer_ids: range, first: bool, last: bool, chunked: bool = True):
        super().__init__()
        self.chunked = chunked  # the loss's cross entropy a slice of rows at a time (TrainConfig.cross_entropy)
        decoder, head = decoder_parts(causal)
        self.config = causal.config
        self.layer_ids = list(layer_ids)
        self.first, self.last = first, last
        self.embed = decoder.embed_tokens if first else None
        self.layers = nn.ModuleList([decoder.layers[i] for i in self.layer_ids])
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm if last else None
        self.head = head if last else None
        self.layer_types = layer_types(self.config, self.layer_ids)
        object.__setattr__(self, "masks", StageMasks(self.config, self.rotary, self.layer_types))  # not a submodule

    def forward(self, x, position_ids=None, attention_mask=None, labels=None):
        hidden = self.embed(x) if self.first else x
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0).expand(hidden.shape[0], -1)
        masks, position_embeddings = self.masks(hidden, position_ids, attention_mask)
        for layer, kind in zip(self.layers, self.layer_types):
            hidden = run_layer(layer, hidden, kind, masks, position_embeddings, position_ids)
        if not self.last:
            return hidden
        return label_loss_sum(self.norm(hidden), labels, self.head, chunked=self.chunked)


class NotOnThisStage(nn.Module):
    """Stands in for a part of the model that lives on another stage (keeps the module names)."""

    def __init__(self, what: str, stage: int):
        super().__init__()
        self.what, self.stage = what, stage

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.what} is not on this rank (pipeline stage {self.stage})")

    def extra_repr(self) -> str:
        return f"{self.what} lives on another stage"


def drop_other_stages(causal, layer_ids, first: bool, last: bool, stage: int) -> None:
    """Replace everything this stage does not run by placeholders, so its memory is released."""
    decoder, _ = decoder_parts(causal)
    keep = set(layer_ids)
    for i in range(len(decoder.layers)):
        if i not in keep:
            decoder.layers[i] = NotOnThisStage(f"decoder layer {i}", stage)
    if not first:
        decoder.embed_tokens = NotOnThisStage("the token embedding", stage)
    if not last:
        decoder.norm = NotOnThisStage("the final norm", stage)
        causal.set_output_embeddings(NotOnThisStage("the LM head", stage))


class RankChunks(nn.Module):
    """The model chunks one rank holds under an interleaved schedule (each runs as its own
    PipelineStage): one module, so that the rank's parameters are `.parameters()`."""

    def __init__(self, chunks: list[StageModule]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def forward(self, *args, **kwargs):
        raise RuntimeError("each model chunk runs through the schedule as its own pipeline stage")


class PipelinedModel(nn.Module):
    """What the training loop holds on a pipeline rank: the (partial) model and this rank's stage."""

    def __init__(self, full: nn.Module, stage: nn.Module, stage_index: int, ranges: list[range]):
        super().__init__()
        self.full = full  # distlab.lm_loss.CausalLMWithLoss with other stages' parts as placeholders
        self.stage = stage
        self.stage_index = stage_index
        self.ranges = ranges

    @property
    def lm(self):
        return self.full.lm

    @property
    def causal_lm(self):
        return self.full.causal_lm

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline stage runs through its schedule (the strategy's train_step)")


def stack_microbatches(micro_batches: list[dict[str, Any]], seq_len: int,
                       device: torch.device) -> dict[str, torch.Tensor]:
    """Concatenate micro-batches row-wise, every row padded to seq_len, position ids always given
    (a stage's receive buffers have one fixed shape; padding carries no labels)."""
    out: dict[str, list[torch.Tensor]] = {"input_ids": [], "labels": [], "position_ids": [], "attention_mask": []}
    has_mask = "attention_mask" in micro_batches[0]
    for b in micro_batches:
        ids = b["input_ids"]
        rows, width = ids.shape
        if width > seq_len:
            raise ValueError(f"a micro-batch is {width} tokens wide, more than seq_len={seq_len}")
        pad = seq_len - width
        out["input_ids"].append(F.pad(ids, (0, pad), value=0))
        out["labels"].append(F.pad(b["labels"], (0, pad), value=IGNORE_INDEX))
        if "position_ids" in b:
            pos = b["position_ids"]
            if pad:  # padding forms its own "sequence", as distlab.data.collate does
                pos = torch.cat([pos, torch.arange(pad).expand(rows, -1)], dim=1)
        else:
            pos = torch.arange(seq_len).expand(rows, -1)
        out["position_ids"].append(pos)
        if has_mask:
            out["attention_mask"].append(F.pad(b["attention_mask"], (0, pad), value=0))
    return {k: torch.cat(v).contiguous().to(device) for k, v in out.items() if v}
