"""Each chapter's plumbing: the sweeps, tables and figures its notebook calls once per cell, so that the
notebook holds the narrative, the mechanism and the results. A notebook imports its own module under
one name (`from distlab.chapters import ch04`), and no other chapter's, so a reader sees where every cell's code
lives: what several chapters share lives below them all (a chapter's script under torchrun in
distlab.launch.scripts, a split run against one device in distlab.lessons), and every name a notebook calls
through a module is defined there, not re-exported (tests/unit/test_notebook_imports.py).
These modules sit at the top of the library: they may import anything below, and nothing imports them.
What a chapter shares with a benchmark lives below both (ch04's sweeps in distlab.pipeline_sweeps, ch01's
measured step in distlab.step_memory); a chapter may run a benchmark's measurement itself (ch05 and ch08:
distlab.bench.lan_balance, lan_ddp), never the other way round.

  ch00  the environment: the ring all-reduce simulated and drawn, the by-hand all-reduce against the
        latency-bandwidth model and the library's sweep, the sweep's figure and phases
  ch01  one device: the optimizer step drawn, the hand-written loop's check against distlab.train, MFU
        beside HFU, key-fact tables, and a real step's memory against the planner (distlab.step_memory)
  ch02  DDP: the idea drawn, the all-reduce's limits, a traced step (buckets, overlap with backward), where a
        step's time goes (compute, transfer, waiting), the fault demo's timeline with its kill and restart
  ch03  FSDP and ZeRO: who holds what drawn, the by-hand ZeRO script's table, each rank's measured state
        against the planner, communication per step (formula against measured), the loss curves, and the
        planner's answers for the LAN cluster's cards
  ch04  pipeline training: GPipe, 1F1B and interleaved 1F1B simulated on ideal stages and drawn, the by-hand
        GPipe script's launch, the loss curves against one device, the bubble sweeps over micro-batches and
        schedules and the study's table (run by distlab.pipeline_sweeps) drawn, and the timeline plots (the
        bubble's theory and reading of a timeline: distlab.measure.bubble)
  ch05  a heterogeneous LAN: the prerequisites and the mode that ran (namespaces or the localhost fallback), the
        even and the balanced split drawn, the all-reduce and DDP-over-the-link figures, the balance runs on
        two and three hosts against their theory with the three-host speedup, the pipeline split's tables, and
        the link-cut demo
  ch06  Slurm pipeline inference: the 2-stage pipeline with a KV cache per stage drawn, the jobs planned,
        the KV cache's bytes (formula and counted), the scaling, batch-sweep, stage-memory (weights and KV
        cache) and width tables and figures, a run's stage timeline with its legend, and the stage-loss demo
  ch07  tensor parallelism: Megatron's split drawn, the by-hand and DTensor scripts run and compared, a layer's
        all-reduce bytes against the formula, a `tp` run's loss against one device, and a step's bytes under
        ddp, fsdp, tp and tp with sequence parallelism (formula against counted)
  ch08  2-D meshes: the FSDP x TP mesh drawn and run against one device (each rank's bytes against the
        planner), HSDP and the 3-D mesh drawn, decoding split by layers against split within layers, and tp
        against ddp across chapter 05's shaped links (step time against link rate, beside bytes / rate)
"""
