"""Planning memory before running: the bytes each rank will hold, from a model config alone.

Read in this order:

  cards    GPUs by their data sheets: exact part, memory (a card's "GB" are GiB), source        ch. 01, 03, 05
  shapes   what a model is made of: parameter layout and counts, LoRA adapters,
           activations per micro-batch, the studied models' published shapes                     ch. 01, 03
  plan     one planner per strategy (`PLANNERS`, `plan_memory`) and the one-device
           case (`estimate_training_memory`)                                                  ch. 01, 03
  load     what a rank holds while the model loads, by how its strategy loads (whole, its stage, its
           slices, partitioned), device and host (`plan_load`); `peak_bytes`, the larger of loading
           and a step, is what every "fits" verdict compares                                   ch. 03, 05
  wire_bytes  the wire-bytes model: what each rank sends per step (the planner's `communication_bytes`;
           `step_bytes_sent` for one step of ddp, fsdp, tp, tp + sequence parallelism as they run)  ch. 03, 07, 08
  advice   the LAN-cluster guide's decision tree (`decide` -> `explain`, both in `recommend`)   ch. 03, 05
  zero_paper  the ZeRO paper's (2 + 2 + K) Psi / N_d model states next to the planner and measured
           bytes, with why they differ (`zero_paper_table`, `explain_zero_paper`)                   ch. 03
  memory   the planner's breakdowns as tables (`breakdown_table`) and each rank's
           measured state beside the plan (`state_vs_plan`)                                   ch. 01, 03, 07

What a run really holds is measured by distlab.measure.state (`measure_state`), which this package
imports and which imports nothing from it.
"""
