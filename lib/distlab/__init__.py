"""distlab: the helper library behind the distributed fine-tuning tutorial notebooks.

Read it by role. The training core sits at the top level, and each other role is a package.
The chapter that introduces a module is on its right.

The training core (read first)
  config      TrainConfig: the run spec every strategy and notebook reads, from YAML        ch. 01
  data        the JSONL data contract: load, validate, chat template, label mask, packing   ch. 01
  models      the offline default model (tiny Qwen2), any HF id or folder, the loss module  ch. 01
  prepare     device, tokenizer, data and the loss-computing model (+ LoRA) for a run       ch. 01
  train       the one training loop  (python -m distlab.train --config ...)                 ch. 01
  device      device/dtype choice, process-group backend, peak FLOP/s, memory readings      ch. 01
  attention   per-document (varlen) attention for packed rows; which SDPA backends run       ch. 01, 04
  dropout     LoRA dropout from 16-bit coins                                                  ch. 01
  metrics     FLOPs per token (MFU) and the JSONL step log                                    ch. 01
  checkpoint  atomic checkpoints a killed run resumes from                                    ch. 02
  faults      deliberate SIGKILLs for the fault-tolerance demos                               ch. 02
  generate    fixed-config generation for before/after answers                                ch. 01
  paths       where data, figures and build outputs live
  compat      the one door to private torch/DeepSpeed symbols, each with its checked version

strategies/   how the loop is distributed: base (the interface), single, ddp, fsdp, zero,      ch. 01-04
              pipeline, ds_pipeline; split/staged/deepspeed_runtime are what they share
measure/      measurement from outside the training code: envcheck, limits, monitor, meter,   ch. 00-04
              comm, state, pipeline_trace, bubble
planning/     memory per rank before running: shapes, plan (one planner per strategy),        ch. 01, 03
              advice (the LAN cluster's decision tree), memory (the chapters' names)
launch/       spec, torchrun scripts, generated folders, the seed's launch matrix, runner,    ch. 02-04
              jobs  (python -m distlab.launch regenerate|check); network (presets by name,
              network_presets.yaml), kubernetes (Namespace, headless Service, Indexed Jobs),
              kubepod (the pods' entrypoint, the Dockerfile), kubecheck (offline validation),
              kubecollect (results from pod logs)  (python -m distlab.launch.k8s validate|collect)
results/      schema (the one results vocabulary), report (scaling tables), collect (results  ch. 02-04
              from logs, the benchmark report)
publish/      regenerate (papermill), book (Jupyter Book + browser check), datagen (the      maintainers
              dataset from data/generator/), provenance (stamps on every figure and table)
bench/        benchmarks that print ratios: trainer_vs_hf, ddp_scaling, pipeline_bubble      ch. 01, 02, 04
workers/      programs inside torchrun ranks: fingerprint, allreduce_bench                    ch. 00
"""

__version__ = "0.1.0"
