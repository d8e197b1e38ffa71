"""Which decoder layers each pipeline stage holds: torch-free arithmetic shared by both pipelines
(distlab.strategies.split), the memory planner and pipeline inference; and which tensor-parallel degrees
a model's heads and FFN width allow (`tp_degree_problem`: strategies.tp and the recommender).

The split (`split_layers`): balanced by layer count by default (the extra layers of an uneven
division go to the earlier stages, since the last stage also carries the LM head), or an explicit
list `stage_layers` of layer counts per stage.
"""

from __future__ import annotations


def split_layers(num_layers: int, num_stages: int, stage_layers: list[int] | None = None) -> list[range]:
    """Decoder-layer indices of each stage: balanced by count, or `stage_layers` counts per stage."""
    if num_stages < 1:
        raise ValueError(f"pipeline_stages={num_stages}: need at least 1 stage")
    if stage_layers is not None:
        counts = [int(c) for c in stage_layers]
        if len(counts) != num_stages:
            raise ValueError(f"stage_layers={stage_layers} has {len(counts)} entries for {num_stages} stages")
        if any(c < 0 for c in counts) or sum(counts) != num_layers:
            raise ValueError(f"stage_layers={stage_layers} must be non-negative and sum to the model's "
                             f"{num_layers} decoder layers")
    else:
        if num_layers < num_stages:
            raise ValueError(f"{num_layers} decoder layers cannot fill {num_stages} stages")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def describe_split(ranges: list[range]) -> list[str]:
    """Human-readable stage contents, e.g. ['stage 0: embeddings + layers 0-1', ...]."""
    out = []
    for s, r in enumerate(ranges):
        parts = (["embeddings"] if s == 0 else []) + ([f"layers {r.start}-{r.stop - 1}"] if len(r) else [])
        parts += ["norm + LM head + loss"] if s == len(ranges) - 1 else []
        out.append(f"stage {s}: " + " + ".join(parts))
    return out


def tp_degree_problem(config, tp: int) -> str | None:
    """Why `tp` ranks cannot split this model's layers (None: they can). A rank holds whole heads, every
    query head needs its key/value head on the same rank, and the FFN is cut in equal blocks. config: an
    HF config object or a dict of its fields."""
    def value(key: str) -> int:
        return int(config[key] if isinstance(config, dict) else getattr(config, key))

    kv, heads, ffn = value("num_key_value_heads"), value("num_attention_heads"), value("intermediate_size")
    if kv % tp or heads % tp or ffn % tp:
        return (f"tensor parallelism over {tp} ranks needs the key/value heads ({kv}), the attention heads ({heads}) "
                f"and the FFN width ({ffn}) divisible by {tp}")
    return None
