"""Attention for packed rows, one document at a time ("varlen" attention).

A packed row holds several conversations back to back; each must attend only to itself. The
standard way to say so is a block-diagonal causal mask, and SDPA then computes every query
against every key of the row (256 x 256 here) and throws most of it away. Computing each
document's causal attention on its own slice does only the useful part: for three ~85-token
documents in a 256-token row, a third of the work. This is what flash-attention's varlen
kernels do on GPUs (with `cu_seqlens`). On CUDA it is exactly that: PyTorch's flash-attention
varlen kernel (`torch.nn.attention.varlen.varlen_attn`) over the whole micro-batch in one call.
Elsewhere it is a loop of SDPA calls with `is_causal=True`, which any device runs.

    load_model(..., attn_implementation=VARLEN)   # or TrainConfig(attn_implementation="varlen")

Where the boundaries come from:
- Training batches carry them, built on the host where the data already is (distlab.data.collate):
  `cu_seq_lens_q`, every document's start in the micro-batch laid end to end, and `max_length_q`, a
  fixed bound (the row width), so nothing in a step reads them back from the device and a compiled
  block sees the same graph for every batch. distlab.lm_loss runs the decoder layers with them.
  On CUDA they go straight to the varlen kernel; elsewhere to `distlab::document_attention`, an
  opaque custom op (with a fake implementation for tracing), so a compiled block has the same
  boundary on a CPU as on a GPU.
- Otherwise, from the position ids, which restart at 0 for every packed document (Hugging Face's
  generate does this for left padding too: every pad gets its own position and the real tokens start
  at 0). That path reads them on the host once per forward (the pipelines' stages and generation).
Anything else takes the ordinary SDPA path with the ordinary mask: generation steps with a KV cache
(query shorter than keys), calls without position ids. The mask is still built there (it is cheap
next to the attention) so that fallback is always exact.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from distlab import compat

VARLEN = "distlab_varlen"  # the name registered with transformers
ALIASES = {"varlen": VARLEN}  # what TrainConfig.attn_implementation may say


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """True where a packed document starts (rows x width): wherever a position is not the previous one plus
    one, and at the start of every row (a padding token restarts its own document)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def document_spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each run of consecutive positions (document_starts)."""
    width = position_ids.shape[1]
    spans = []
    for row in document_starts(position_ids).cpu().tolist():
        cuts = [i for i, s in enumerate(row) if s] + [width]
        spans.append(list(zip(cuts[:-1], cuts[1:])))
    return spans


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     is_causal=None, **kwargs):
    """transformers attention-interface function: (batch, heads, seq, dim) in, (batch, seq, heads, dim) out."""
    dropout_p = dropout if module.training else 0.0
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is not None and dropout_p == 0.0 and query.shape[2] == key.shape[2]:
        return document_attention(query, key, value, cu_seqlens, kwargs["max_length_q"], scaling), None
    position_ids = kwargs.get("position_ids")
    if position_ids is None or query.shape[2] != key.shape[2] or position_ids.shape[-1] != query.shape[2]:
        # deferred: transformers is slow to import
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out_dtype = query.dtype
    sixteen_bit = torch.is_autocast_enabled("cpu") or query.dtype in (torch.bfloat16, torch.float16)
    if query.device.type == "cpu" and sixteen_bit:
        # On CPU attention, a small share of the FLOPs, runs in fp32 whenever the model computes in 16 bits,
        # under autocast or with 16-bit weights (DeepSpeed's bf16 mode): PyTorch's CPU flash-attention backward
        # in bf16 took twice its fp32 time here (profiled), and it keeps a kernel for every sequence shape it
        # meets, never freed: one per document length of packed rows, so a bf16 run's resident memory grew with
        # every micro-batch it ran (traced in chapter 04's pipeline table; fp32 stays flat). Autocast would
        # cast the inputs back down, so it is switched off here.
        with torch.autocast("cpu", enabled=False):
            out, _ = _varlen(query.float(), key.float(), value.float(), position_ids, dropout_p, scaling)
        return out.to(out_dtype), None
    return _varlen(query, key, value, position_ids, dropout_p, scaling)


def document_attention(query, key, value, cu_seqlens: torch.Tensor, max_seqlen: int, scaling=None) -> torch.Tensor:
    """Causal attention within each document of a micro-batch whose boundaries are given: `cu_seqlens`
    (int32, on the model's device) holds every document's start with the rows laid end to end, then
    batch x seq; `max_seqlen` bounds a document's length. (batch, heads, seq, dim) in, (batch, seq,
    heads, dim) out. Reads nothing back to the host: the kernel takes the boundaries as they are."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    half = _flash_dtype(query)
    if half is not None:
        return _flash_documents(query.to(half), key.to(half), value.to(half), cu_seqlens, max_seqlen, scale)
    if key.shape[1] != query.shape[1]:  # grouped-query attention: each key/value head serves several query heads
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    out_dtype = query.dtype
    if query.device.type == "cpu" and (torch.is_autocast_enabled("cpu") or out_dtype != torch.float32):
        # fp32 on a CPU whenever the model computes in 16 bits: see varlen_attention
        with torch.autocast("cpu", enabled=False):
            out, _ = torch.ops.distlab.document_attention(query.float(), key.float(), value.float(), cu_seqlens,
                                                          scale)
        return out.to(out_dtype).transpose(1, 2).contiguous()
    out, _ = torch.ops.distlab.document_attention(query, key, value, cu_seqlens, scale)
    return out.transpose(1, 2).contiguous()


def _flash_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype flash-attention's varlen kernel runs `query` in, or None where it cannot: off CUDA,
    without the kernel (PyTorch < 2.10), or in fp32 (flash kernels take 16-bit operands only). Under autocast
    the rotary embedding hands over fp32 queries (fp32 cos/sin times bf16 projections): they run in the
    autocast dtype, as SDPA, which autocast lists, would cast them itself."""
    if not query.is_cuda or _varlen_attn is None:
        return None
    half = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else query.dtype
    return half if half in (torch.float16, torch.bfloat16) else None


def _flash_documents(query, key, value, cu_seqlens, max_seqlen: int, scale: float):
    """flash-attention's varlen kernel over the micro-batch laid end to end: (batch * seq, heads, dim)."""
    batch, heads, seq, dim = query.shape

    def flat(t):  # (batch, heads, seq, dim) -> (batch * seq, heads, dim)
        return t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim)

    scale_kw = {"scale": scale} if _VARLEN_TAKES_SCALE else {}  # 2.10 had none: always 1/sqrt(dim), Qwen2's too
    if key.shape[1] != heads and not _VARLEN_TAKES_GQA:  # older kernels want one key/value head per query head
        key, value = (t.repeat_interleave(heads // key.shape[1], dim=1) for t in (key, value))
    gqa = {"enable_gqa": True} if key.shape[1] != heads else {}
    out = _varlen_attn(flat(query), flat(key), flat(value), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                       **scale_kw, **gqa, **_CAUSAL)
    return out.view(batch, seq, heads, dim)


def host_boundaries(cu_seqlens: torch.Tensor) -> list[int]:
    """The document starts as Python ints, read by the CPU kernel below (the one host read it makes, as
    flash-attention's kernel reads them from device memory)."""
    return cu_seqlens.tolist()


def _documents(cu_seqlens: torch.Tensor, seq: int):
    """(row, start, end) of every non-empty document, from starts in end-to-end coordinates."""
    bounds = host_boundaries(cu_seqlens)
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            row = s // seq
            yield row, s - row * seq, e - row * seq


# The CPU kernel: PyTorch's CPU flash attention (causal) on each document's slice, its log-sum-exp kept for the
# backward, which calls the matching backward kernel on the same slices. Opaque to torch.compile: Dynamo never
# sees the loop over documents, so no boundary becomes a constant it must guard on.
@torch.library.custom_op("distlab::document_attention", mutates_args=())
def _document_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seq, _ = query.shape
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    lse = torch.zeros(batch, heads, seq, dtype=torch.float32, device=query.device)
    for b, s, e in _documents(cu_seqlens, seq):
        o, m = compat.cpu_flash_attention(query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e],
                                          True, scale)
        out[b:b + 1, :, s:e] = o
        lse[b:b + 1, :, s:e] = m
    return out, lse


@_document_attention_op.register_fake
def _(query, key, value, cu_seqlens, scale):
    batch, heads, seq, _ = query.shape
    return (torch.empty_like(query, memory_format=torch.contiguous_format),
            query.new_empty(batch, heads, seq, dtype=torch.float32))


@torch.library.custom_op("distlab::document_attention_backward", mutates_args=())
def _document_attention_backward_op(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                    value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                    cu_seqlens: torch.Tensor, scale: float
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = [torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (query, key, value)]
    for b, s, e in _documents(cu_seqlens, query.shape[2]):
        part = (slice(b, b + 1), slice(None), slice(s, e))
        pieces = compat.cpu_flash_attention_backward(grad_out[part], query[part], key[part], value[part], out[part],
                                                     lse[part], True, scale)
        for grad, piece in zip(grads, pieces):
            grad[part] = piece
    return tuple(grads)


@_document_attention_backward_op.register_fake
def _(grad_out, query, key, value, out, lse, cu_seqlens, scale):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (query, key, value))


def _setup_context(ctx, inputs, output):
    query, key, value, cu_seqlens, scale = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, cu_seqlens)
    ctx.scale = scale


def _backward(ctx, grad_out, _grad_lse):
    query, key, value, out, lse, cu_seqlens = ctx.saved_tensors
    grad_q, grad_k, grad_v = torch.ops.distlab.document_attention_backward(
        grad_out.contiguous(), query, key, value, out, lse, cu_seqlens, ctx.scale)
    return grad_q, grad_k, grad_v, None, None


_document_attention_op.register_autograd(_backward, setup_context=_setup_context)


def _varlen(query, key, value, position_ids, dropout_p: float, scaling):
    spans = _spans_for(position_ids, query.shape[0])
    half = _flash_dtype(query) if dropout_p == 0.0 else None
    if half is not None:
        return _flash_varlen(query.to(half), key.to(half), value.to(half), spans, scaling)
    if key.shape[1] != query.shape[1]:  # grouped-query attention: each key/value head serves several query heads
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    if all(len(row) == 1 for row in spans):  # one document per row: a single causal call
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, scale=scaling, is_causal=True)
    else:
        rows = []
        for b, row in enumerate(spans):
            q, k, v = query[b:b + 1], key[b:b + 1], value[b:b + 1]
            rows.append(torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e],
                                                                  dropout_p=dropout_p, scale=scaling, is_causal=True)
                                   for s, e in row], dim=2))
        out = torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


try:  # PyTorch >= 2.10: flash-attention's variable-length kernel
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # older PyTorch: the SDPA loop everywhere
    _varlen_attn = None

_VARLEN_PARAMETERS = inspect.signature(_varlen_attn).parameters if _varlen_attn is not None else {}
# PyTorch 2.10 says causal with is_causal=True; later versions with a (left, right) window, (-1, 0)
_CAUSAL = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMETERS else {"is_causal": True}
_VARLEN_TAKES_SCALE = "scale" in _VARLEN_PARAMETERS
_VARLEN_TAKES_GQA = "enable_gqa" in _VARLEN_PARAMETERS
_last_spans: tuple = (None, None)  # (position_ids, spans) of the forward in progress


def _spans_for(position_ids: torch.Tensor, rows: int) -> list[list[tuple[int, int]]]:
    """document_spans, read from the device once per forward: every layer gets the same position-id
    tensor (the cache keys on that object itself, never on a fresh view of it), and each reading waits
    for the GPU to catch up with the host. One row of position ids serves every row of the batch."""
    global _last_spans
    if _last_spans[0] is not position_ids:
        _last_spans = (position_ids, document_spans(position_ids))
    spans = _last_spans[1]
    return spans * rows if len(spans) == 1 and rows > 1 else spans


def _flash_varlen(query, key, value, spans, scaling):
    """All documents of the micro-batch in one flash-attention varlen call, boundaries read from `spans`."""
    batch, _, seq, dim = query.shape
    starts = [b * seq + s for b, row in enumerate(spans) for s, _ in row] + [batch * seq]
    longest = max(e - s for row in spans for s, e in row)
    cu_seq = torch.tensor(starts, dtype=torch.int32).to(query.device, non_blocking=True)
    return _flash_documents(query, key, value, cu_seq, longest, scaling if scaling is not None else dim ** -0.5), None


def register() -> None:
    """Make VARLEN a valid `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface  # deferred: transformers is slow to import

    # deferred: transformers is slow to import
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(VARLEN, varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, sdpa_mask)


def resolve(name: str) -> str:
    """The transformers name for a config's attn_implementation, registering ours when asked for."""
    name = ALIASES.get(name, name)
    if name == VARLEN:
        register()
    return name


def sdpa_backends(device: str | torch.device = "cpu", heads: int = 4, head_dim: int = 64, seq: int = 128) -> list[dict]:
    """Which scaled_dot_product_attention backends run on this device, and which one PyTorch picks,
    for the two kinds of attention the tutorial's batches use: plain causal (is_causal, no mask)
    and a boolean mask (packed rows: block-diagonal causal; padded rows: causal + padding). Each
    backend is tried alone (torch.nn.attention.sdpa_kernel); the pick is PyTorch's own dispatch
    (distlab.compat.fused_sdp_choice)."""

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(2, heads, seq, head_dim, device=device, dtype=dtype)
    mask = torch.ones(2, 1, seq, seq, dtype=torch.bool, device=device).tril()
    names = {0: "math", 1: "flash", 2: "mem_efficient", 3: "cudnn", 4: "overrideable"}
    rows = []
    for kind, kwargs in (("causal, no mask", {"is_causal": True}),
                         ("boolean mask (packing/padding)", {"attn_mask": mask})):
        row = {"attention": kind}
        for name, backend in (("math", SDPBackend.MATH), ("flash", SDPBackend.FLASH_ATTENTION),
                              ("mem_efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, q, q, **kwargs)
                row[name] = True
            except RuntimeError:
                row[name] = False
        try:
            choice = compat.fused_sdp_choice(q, q, q, kwargs.get("attn_mask"), 0.0, kwargs.get("is_causal", False))
            row["pytorch picks"] = names.get(choice, str(choice))
        except RuntimeError:  # PyTorch could not pick for these inputs on this device
            row["pytorch picks"] = "unknown"
        rows.append(row)
    return rows
