"""distlab: the helper library behind the distributed fine-tuning tutorial notebooks.

Modules, one concept each:
  data        the JSONL data contract: load, validate, render with the chat template, mask, pack
  models      the offline default model (tiny Qwen2) and loading of any HF model id or folder
  device      device/dtype choice, peak FLOP/s (table or measured), memory readings
  train       the one training loop (+ `python -m distlab.train --config`)
  strategies  how the loop is distributed (single device here; ddp/fsdp/zero/pipeline beside it)
  generate    fixed-config generation for before/after comparisons
  provenance  who/what/when stamps for every figure, table and run
"""

__version__ = "0.1.0"
