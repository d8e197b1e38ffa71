"""GPUs by their data sheets: the exact part, its memory, and where that number comes from.

One unit rule for every chapter: a GPU's memory is sold as "GB", but it is built from DRAM chips whose
capacity is a power of two, so a "12 GB" card holds 12 GiB = 12 x 2^30 bytes (nvidia-smi reports a 12 GB
card as 12288 MiB, less what the driver keeps). Plans are in GiB and are compared with `memory_gib`
directly; a GB of disk or of a network link stays 10^9 bytes.

The names matter: the LAN cluster's 12 GB and 8 GB GPUs are laptop parts. The desktop cards of the
same names carry more memory (the desktop RTX 5070 Ti has 16 GB, the desktop RTX 4070 12 GB), so a
verdict made for "an RTX 4070" depends on which one is meant.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd


@dataclass(frozen=True)
class Card:
    name: str  # the exact part, as its maker names it
    memory_gib: float  # what the data sheet sells as GB: GiB (see the module docstring)
    memory_type: str
    source: str  # the maker's page that states the memory

    def as_device(self, name: str | None = None) -> dict:
        """The planner's device entry (`distlab.planning.advice.recommend`): a name and memory_gib."""
        return {"name": name or self.name, "memory_gib": self.memory_gib}


CARDS = {c.name: c for c in (
    Card("GeForce RTX 5070 Ti Laptop GPU", 12, "GDDR7",
         "https://www.nvidia.com/en-us/geforce/laptops/50-series/"),
    Card("GeForce RTX 4070 Laptop GPU", 8, "GDDR6",
         "https://www.nvidia.com/en-us/geforce/laptops/40-series/"),
    Card("GeForce RTX 3070 Ti Laptop GPU", 8, "GDDR6",
         "https://www.nvidia.com/en-us/geforce/laptops/30-series/"),
    Card("GeForce RTX 5070 Ti", 16, "GDDR7",
         "https://www.nvidia.com/en-us/geforce/graphics-cards/50-series/rtx-5070-family/"),
    Card("GeForce RTX 4070", 12, "GDDR6X",
         "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4070-family/"),
    Card("NVIDIA A100 40GB", 40, "HBM2", "https://www.nvidia.com/en-us/data-center/a100/"),
    Card("NVIDIA A100 80GB", 80, "HBM2e", "https://www.nvidia.com/en-us/data-center/a100/"),
    Card("NVIDIA H100 SXM", 80, "HBM3", "https://www.nvidia.com/en-us/data-center/h100/"),
)}

# The LAN-cluster guide's three laptops' GPUs: its "12 GB" and "8 GB" are these laptop parts.
LAN_CARDS = [CARDS["GeForce RTX 5070 Ti Laptop GPU"], CARDS["GeForce RTX 4070 Laptop GPU"],
             CARDS["GeForce RTX 3070 Ti Laptop GPU"]]
LAN_CLUSTER = [c.as_device() for c in LAN_CARDS]


def card_table(cards=None):
    """The catalogue as a table (pandas): part, memory, memory type and source."""
    rows = [{"part": c.name, "memory (GiB)": c.memory_gib, "memory type": c.memory_type, "source": c.source}
            for c in (cards or CARDS.values())]
    return pd.DataFrame(rows)
