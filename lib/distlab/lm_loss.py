"""The loss every training forward ends in: a causal LM's summed next-token cross entropy over label tokens
only, the LM head applied at those positions alone (`label_loss_sum`), and the whole model with that loss as
one module (`CausalLMWithLoss`) for the strategies to wrap, the pipelines' last stage and the default model's
pretraining (distlab.tiny_base).
"""

from __future__ import annotations

import torch

from distlab.data import IGNORE_INDEX


class CausalLMWithLoss(torch.nn.Module):
    """A causal LM whose forward returns the summed next-token loss over label tokens only.

    The LM head runs only on positions whose next token is a label: prompt tokens (a third of our
    data, often more) never pay for the vocabulary projection, and the full (tokens x vocab)
    logits are never materialised, which matters for 150k-token vocabularies on GPUs. Strategies
    wrap this module, so DDP/FSDP see one forward that does everything the step needs.

    Works for models whose head is a plain linear layer on the decoder output (Llama, Qwen2,
    Mistral...). Models that post-process logits (e.g. Gemma's soft-capping) need the full
    forward instead."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    @property
    def causal_lm(self):
        """The transformers model inside (under a PEFT wrapper, with its adapters injected)."""
        return self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm

    def forward(self, input_ids, labels, position_ids=None, attention_mask=None):
        causal = self.causal_lm
        # use_cache=False: with a cache object present, transformers does not derive the
        # block-diagonal mask from restarting position ids, and packed rows would leak.
        hidden = causal.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                      attention_mask=attention_mask, use_cache=False).last_hidden_state
        return label_loss_sum(hidden, labels, causal.get_output_embeddings())


def label_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, head) -> torch.Tensor:
    """Summed next-token cross entropy over label positions only, the head applied to those alone.

    `head` maps hidden states to logits (the LM head module, or any callable such as a tied
    embedding's `F.linear`). Every forward that ends in a loss uses this one function: the
    unsplit model here and the last stage of both pipelines."""
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    logits = head(hidden[:, :-1][keep])
    loss = torch.nn.functional.cross_entropy(logits.float(), targets[keep], reduction="sum")
    # a head split by vocabulary (strategies.tp, vocab_parallel) gives a replicated DTensor: the loop reads a tensor
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
