"""The pipelined generation loop every rank runs (rank s = stage s of `world` stages).

Each micro-batch has its own KV cache on every stage. In one decoding step the micro-batches pass
through the stages one after another: stage 0 embeds micro-batch m's newest tokens and sends its
hidden states on, the last stage turns them into logits, samples, and sends the new tokens back to
every stage (stage 0 embeds them next; every stage extends its padding mask and sees when a
micro-batch has finished). While the last stage works on micro-batch m, stage 0 already works on
m + 1: with at least as many micro-batches in flight as stages the pipeline is full after the first
token. `in_flight=1` is the Slurm inference report's design (one prompt batch at a time through the stages: only
one stage busy at any moment).

Sends are asynchronous (isend) and every rank walks the micro-batches in the same order, so a
blocking receive always has its matching send on the way: no deadlock. With world=1 the loop runs
without torch.distributed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from distlab.inference.batches import MicroBatch

HIDDEN_TAG, TOKEN_TAG = 1, 2


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 32
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: need at least 1")
        if not self.greedy and not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError(f"temperature={self.temperature}, top_p={self.top_p}: need temperature > 0 "
                             "and 0 < top_p <= 1")


def sample(logits: torch.Tensor, cfg: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    if cfg.greedy:
        return logits.argmax(-1)
    probs = torch.softmax(logits / cfg.temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    sorted_p[(sorted_p.cumsum(-1) - sorted_p) > cfg.top_p] = 0  # keep the smallest set reaching top_p
    choice = torch.multinomial(sorted_p, 1, generator=gen)
    return order.gather(-1, choice).squeeze(-1)


@dataclass
class MicroState:
    """One micro-batch's generation state on one rank (every rank keeps the same tokens)."""

    mb: MicroBatch
    cache: object
    mask: torch.Tensor
    positions: torch.Tensor
    tokens: list[list[int]]
    finished: torch.Tensor
    generator: torch.Generator | None
    done: bool = False
    pending: torch.Tensor | None = None   # last stage: tokens sampled, not yet applied
    last_tokens: torch.Tensor | None = None  # the newest tokens, stage 0's next input
    token_times: list[float] = field(default_factory=list)   # last stage: when each step's tokens came


class Pipeline:
    """What one rank needs to play its stage: the stage module, its place, the sampling rule."""

    def __init__(self, stage, rank: int, world: int, config, eos_id: int, pad_id: int, sampling: Sampling):
        self.stage, self.rank, self.world = stage, rank, world
        self.config, self.eos_id, self.pad_id, self.sampling = config, eos_id, pad_id, sampling
        self.first, self.last = rank == 0, rank == world - 1
        self.sends: list = []
        self.events: list[dict] = []   # the stage timeline: one entry per forward (sampling included, sends not)
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _isend(self, tensor, dst, tag):
        self.sends.append((dist.isend(tensor, dst=dst, tag=tag), tensor))

    def _recv(self, shape, dtype, src, tag):
        buf = torch.empty(shape, dtype=dtype, device=self.device)  # NCCL moves GPU tensors only
        dist.recv(buf, src=src, tag=tag)
        return buf

    def new_state(self, mb: MicroBatch) -> MicroState:
        from transformers import DynamicCache  # deferred: transformers is slow to import

        gen = None
        if not self.sampling.greedy:
            gen = torch.Generator(device=self.device).manual_seed(self.sampling.seed + mb.index)
        return MicroState(mb, DynamicCache(config=self.config), mb.attention_mask.to(self.device),
                          mb.position_ids().to(self.device), [[] for _ in range(mb.rows)],
                          torch.zeros(mb.rows, dtype=torch.bool, device=self.device), gen)

    def _step(self, st: MicroState, step: int) -> None:
        rows = st.mb.rows
        width = st.mb.input_ids.shape[1] if step == 0 else 1
        if self.first:
            x = st.mb.input_ids.to(self.device) if step == 0 else st.last_tokens.view(rows, 1)
        else:
            x = self._recv((rows, width, self.config.hidden_size), self.dtype, self.rank - 1, HIDDEN_TAG)
        begin = self.now()
        out = self.stage(x, st.positions, st.mask, st.cache)
        if not self.last:
            end = self.now()
            self._isend(out.contiguous(), self.rank + 1, HIDDEN_TAG)
        else:
            tok = sample(out, self.sampling, st.generator)
            tok = torch.where(st.finished, torch.full_like(tok, self.pad_id), tok)
            st.pending = tok
            end = self.now()
            st.token_times.append(end)
            for r in range(self.world - 1):
                self._isend(tok.clone(), r, TOKEN_TAG)
        # the forward ends before its send starts: a neighbour's forward that the send feeds begins after it
        self.events.append({"mb": st.mb.index, "step": step, "start": begin, "end": end,
                            "kind": "prefill" if step == 0 else "decode"})

    def _apply_tokens(self, st: MicroState, step: int) -> None:
        tok = st.pending if self.last else self._recv((st.mb.rows,), torch.long, self.world - 1, TOKEN_TAG)
        st.last_tokens = tok
        for r in range(st.mb.rows):
            if not st.finished[r]:
                st.tokens[r].append(int(tok[r]))
        st.finished |= tok == self.eos_id
        st.mask = torch.cat([st.mask, torch.ones_like(st.mask[:, :1])], dim=1)
        st.positions = st.positions[:, -1:] + 1
        st.done = bool(st.finished.all()) or step >= self.sampling.max_new_tokens

    def run(self, batches: list[MicroBatch], in_flight: int | None = None, on_done=None) -> list[MicroState]:
        """Generate for every micro-batch, `in_flight` of them at a time (default: all at once).
        `on_done(state)` is called on every rank the moment a micro-batch has its last token (the last
        stage writes its completions there, before any later micro-batch can finish)."""
        self.dtype = next(self.stage.parameters()).dtype
        self.device = next(self.stage.parameters()).device
        in_flight = in_flight or len(batches)
        self.t0 = time.perf_counter()
        states = []
        for start in range(0, len(batches), in_flight):
            group = [self.new_state(mb) for mb in batches[start:start + in_flight]]
            for step in range(self.sampling.max_new_tokens + 1):
                for st in group:
                    if st.done:
                        continue
                    if step > 0:
                        self._apply_tokens(st, step)
                        if st.done:
                            if on_done is not None:
                                on_done(st)
                            continue
                    self._step(st, step)
                if all(st.done for st in group):
                    break
            states += group
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
        return states
