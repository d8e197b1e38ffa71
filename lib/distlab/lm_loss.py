"""The loss every training forward ends in: a causal LM's summed next-token cross entropy over label tokens
only, the LM head applied at those positions alone (`label_loss_sum`), and the whole model with that loss as
one module (`CausalLMWithLoss`) for the strategies to wrap, the pipelines' last stage and the default model's
pretraining (distlab.tiny_base).

Two things keep a step free of host reads and of the largest transient tensor a small model makes:
- Packed batches carry their document boundaries and label positions (distlab.data.collate, built on the
  host). With per-document attention the decoder layers run here directly with those boundaries: no 4-D
  mask is built, and nothing asks the device how many labels or documents there are.
- Chunked cross entropy (`cross_entropy="chunked"`, the default): the head and the cross entropy run on a
  slice of the labelled rows at a time, and each slice's gradients are taken right there (the softmax
  minus the one-hot target, times the head weight and times the slice), so the rows x vocabulary fp32
  logits exist one slice at a time, never whole: for a 151,936-token vocabulary, 0.6 MB per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distlab import compat
from distlab.attention import VARLEN
from distlab.data import IGNORE_INDEX

CHUNK_ELEMENTS = 2 ** 24  # logits per slice of chunked cross entropy: 64 MiB in fp32, whatever the vocabulary


class CausalLMWithLoss(torch.nn.Module):
    """A causal LM whose forward returns the summed next-token loss over label tokens only.

    The LM head runs only on positions whose next token is a label: prompt tokens (a third of our
    data, often more) never pay for the vocabulary projection, and the full (tokens x vocab)
    logits are never materialised, which matters for 150k-token vocabularies on GPUs. Strategies
    wrap this module, so DDP/FSDP see one forward that does everything the step needs.

    Works for models whose head is a plain linear layer on the decoder output (Llama, Qwen2,
    Mistral...). Models that post-process logits (e.g. Gemma's soft-capping) need the full
    forward instead."""

    def __init__(self, lm: torch.nn.Module, cross_entropy: str = "chunked"):
        super().__init__()
        self.lm = lm
        self.cross_entropy = cross_entropy  # "chunked" | "plain" (TrainConfig.cross_entropy)

    @property
    def causal_lm(self):
        """The transformers model inside (under a PEFT wrapper, with its adapters injected)."""
        return self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm

    def forward(self, input_ids, labels, position_ids=None, attention_mask=None, cu_seq_lens_q=None,
                max_length_q=None, label_index=None, label_targets=None):
        causal = self.causal_lm
        decoder = causal.get_decoder()
        if cu_seq_lens_q is not None and runs_layers_directly(decoder):
            hidden = run_layers(decoder, input_ids, position_ids, cu_seq_lens_q, max_length_q)
        else:
            # use_cache=False: with a cache object present, transformers does not derive the
            # block-diagonal mask from restarting position ids, and packed rows would leak.
            hidden = decoder(input_ids=input_ids, position_ids=position_ids,
                             attention_mask=attention_mask, use_cache=False).last_hidden_state
        return label_loss_sum(hidden, labels, causal.get_output_embeddings(), label_index, label_targets,
                              chunked=self.cross_entropy == "chunked")


def runs_layers_directly(decoder: torch.nn.Module) -> bool:
    """Whether `run_layers` can stand in for this decoder's forward: a Llama/Qwen2-style stack (embedding,
    rotary embedding, layers, final norm) of full-attention layers using per-document attention."""
    config = decoder.config
    return (compat.attn_implementation(config) == VARLEN
            and all(hasattr(decoder, part) for part in ("embed_tokens", "rotary_emb", "layers", "norm"))
            and all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ["full_attention"]))


def run_layers(decoder: torch.nn.Module, input_ids, position_ids, cu_seqlens, max_seqlen: int) -> torch.Tensor:
    """The decoder's forward for a packed batch whose document boundaries are given: what transformers' own
    forward does, less the 4-D mask (per-document attention never reads it) and the check for packed rows
    (it reads the device). Every layer gets the boundaries; the final norm's output comes back."""
    # the number of documents changes from batch to batch: a compiled block takes it as a symbol, not a
    # constant, from its first batch on (no recompile for the second)
    compat.mark_varying(cu_seqlens, 0)
    hidden = decoder.embed_tokens(input_ids)
    position_embeddings = decoder.rotary_emb(hidden, position_ids)
    bounds = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_seqlen,
              "max_length_k": max_seqlen}
    for layer in decoder.layers[:decoder.config.num_hidden_layers]:
        hidden = layer(hidden, attention_mask=None, position_embeddings=position_embeddings, position_ids=position_ids,
                       past_key_values=None, use_cache=False, **bounds)
    return decoder.norm(hidden)


def label_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, head, label_index=None, label_targets=None,
                   chunked: bool = True) -> torch.Tensor:
    """Summed next-token cross entropy over label positions only, the head applied to those alone.

    `head` maps hidden states to logits (the LM head module, or any callable such as a tied
    embedding's `F.linear`). Every forward that ends in a loss uses this one function: the
    unsplit model here and the last stage of both pipelines. `label_index`/`label_targets`
    (distlab.data.label_positions) pick the rows without a boolean mask; without them the mask is
    taken from `labels`. `chunked`: see the module docstring; it applies to a plain linear head
    (its weight an ordinary tensor: not a DTensor, not a ZeRO-3 partition), the others take the
    plain cross entropy."""
    if label_index is not None and label_targets is not None and not hasattr(hidden, "full_tensor"):
        rows, targets = hidden.reshape(-1, hidden.shape[-1]).index_select(0, label_index), label_targets
    else:
        targets = labels[:, 1:]
        keep = targets != IGNORE_INDEX
        rows, targets = hidden[:, :-1][keep], targets[keep]
    weight = _plain_linear_weight(head)
    if chunked and weight is not None and not hasattr(rows, "full_tensor"):  # DTensor rows: the plain one
        return chunked_cross_entropy_sum(rows, weight, targets)
    loss = F.cross_entropy(head(rows).float(), targets, reduction="sum")
    # a head split by vocabulary (strategies.tp, vocab_parallel) gives a replicated DTensor: the loop reads a tensor
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def _plain_linear_weight(head) -> torch.Tensor | None:
    """The weight of a bias-free linear head whose weight is an ordinary tensor; None for anything else."""
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    weight = head.weight
    if hasattr(weight, "full_tensor") or hasattr(weight, "ds_id"):  # DTensor shard, ZeRO-3 partition
        return None
    return weight


def chunked_cross_entropy_sum(rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sum over rows of cross_entropy(rows @ weight.T, targets), a slice of rows at a time (fp32 logits)."""
    if torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad):
        return _ChunkedHeadLoss.apply(rows, weight, targets)
    step = _chunk_rows(weight)
    total = rows.new_zeros((), dtype=torch.float32)
    for start in range(0, rows.shape[0], step):
        logits = F.linear(rows[start:start + step], weight).float()
        total = total + F.cross_entropy(logits, targets[start:start + step], reduction="sum")
    return total


def _chunk_rows(weight: torch.Tensor) -> int:
    return max(1, CHUNK_ELEMENTS // weight.shape[0])


class _ChunkedHeadLoss(torch.autograd.Function):
    """The head and the cross entropy, slice by slice, with both gradients taken in the forward (the loss is
    the last thing a step computes: its backward is only a scaling by the incoming gradient). For one slice
    h (rows x hidden) with logits z = h W^T: d loss / d z = softmax(z) - onehot(target), so
    d h = (softmax - onehot) W and d W = (softmax - onehot)^T h. Matmuls run in the autocast dtype, as the
    plain path's do; the logits and the softmax in fp32."""

    @staticmethod
    def forward(ctx, rows, weight, targets):
        step = _chunk_rows(weight)
        grad_rows = torch.empty_like(rows) if rows.requires_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight.requires_grad else None
        total = rows.new_zeros((), dtype=torch.float32)
        for start in range(0, rows.shape[0], step):
            h, t = rows[start:start + step], targets[start:start + step]
            logits = F.linear(h, weight).float()
            log_norm = torch.logsumexp(logits, dim=-1)
            total = total + (log_norm - logits.gather(1, t[:, None]).squeeze(1)).sum()
            dlogits = logits.sub_(log_norm[:, None]).exp_()  # the softmax, in place of the logits
            dlogits[torch.arange(len(t), device=t.device), t] -= 1.0
            dlogits = dlogits.to(torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type)
                                 else h.dtype)
            if grad_rows is not None:
                grad_rows[start:start + step] = dlogits @ weight.to(dlogits.dtype)
            if grad_weight is not None:
                grad_weight += (dlogits.t() @ h.to(dlogits.dtype)).float()
        ctx.save_for_backward(grad_rows, grad_weight)  # None where that input needs no gradient
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_rows, grad_weight = ctx.saved_tensors
        # a 0-d fp32 factor keeps each gradient's own dtype (the rows'); the weight's sum was kept in fp32
        return (grad_rows * grad_total if grad_rows is not None else None,
                (grad_weight * grad_total).to(ctx.weight_dtype) if grad_weight is not None else None, None)
