"""distlab: the helper library behind the distributed fine-tuning tutorial notebooks.

Read it bottom up, layer by layer: a module imports only from its own layer and the ones below
(tests/unit/test_structure.py checks it, and that every module is listed here). The chapter that introduces a
module is on its right.

1. The core: what a training run is made of (torch-free where it can be: config, paths, provenance,
   layer_split, cli, jsonio and yaml_input load no torch)
  config       TrainConfig: the run spec every strategy and notebook reads, from YAML; strategy and model names ch. 01
  paths        where data, figures and build outputs live
  provenance   device, model, world size, commit, date and inputs digest stamped on every figure and table
  cli          how every command ends on bad input: one line, exit 2
  markdown     Markdown table cells from outside values, escaped (|, newlines, HTML)
  jsonio       strict JSON text (NaN and infinities as null), how every JSON a program reads is written
  yaml_input   bounded YAML: alias expansion, nesting depth and binary files refused before any check
  data         the JSONL data contract: load, validate, chat template, label mask, packing             ch. 01
  batching     which rows each rank takes at each step (StepBatches), uneven shares (rows_per_rank)    ch. 01, 05
  models       loading models: the offline default (tiny Qwen2), random presets, any HF id or folder   ch. 01
  tiny_base    the offline default model, built once: tokenizer, Qwen2 shape, pretraining run          ch. 01
  lm_loss      the loss module: next-token loss on label tokens only, the LM head applied there alone  ch. 01
  schedule     the learning-rate schedule: linear warm-up, then a cosine down to a floor               ch. 01
  master_weights  fp32 master copies of bf16 weights that AdamW steps (master_weights: true)
  attention    per-document (varlen) attention for packed rows; which SDPA backends run                ch. 01, 04
  dropout      LoRA dropout from 16-bit coins                                                          ch. 01
  device       device/dtype choice, process-group backend, peak FLOP/s, memory readings                ch. 01
  pretrained   a real pretrained base offline: SmolLM2-135M-Instruct from a package's GGUF file     ch. 01
  model_build  what building and loading a model folder share: a lock for ranks that all build it,
               a finished build swapped in whole, transformers' progress bars silenced              ch. 01
  prepare      device, tokenizer, data and the loss-computing model (+ LoRA) for a run                 ch. 01
  sharded_load  loading that shards: a weightless model, sharded, then each rank reads only its part    ch. 03, 07
  metrics      FLOPs per token (MFU) and the JSONL step log                                            ch. 01
  checkpoint   atomic checkpoints a killed run resumes from                                            ch. 02
  safe_load    loading saved state as tensors and plain data only: a file never runs code              ch. 02
  preemption   a scheduler's SIGTERM / SIGUSR1: finish the step, save it on every rank, exit 143        ch. 02
  folder_lock  one run per output folder: a lock naming its holder, taken over from a dead run        ch. 02
  faults       deliberate SIGKILLs, signals, full disks and slowdowns for the fault-tolerance demos    ch. 02, 05
  generate     fixed-config generation for before/after answers                                        ch. 01
  keyfacts     key-fact accuracy: which of an answer's expected facts it states                         ch. 01
  layer_split  which decoder layers each pipeline stage holds (the pipelines, planner and inference)   ch. 04
  machine      what this machine has (cores, GPUs, root, Slurm, namespaces) and each chapter's `auto` values ch. 00
  compat       the one door to private torch/DeepSpeed symbols, each with its checked version

2. measure/     watching a run from outside the training code: envcheck, limits, utilisation, meter,    ch. 00-04
                comm, state, pipeline_trace, bubble
   results/     the one results vocabulary (schema), what every rank records, reading it back from     ch. 02-03
                logs, the scaling table and the benchmark report
3. strategies/  how the loop is distributed: single, ddp, fsdp, zero, pipeline, ds_pipeline, tp, fsdp_tp ch. 01-08
4. train        the one training loop  (python -m distlab.train --config ...)                          ch. 01
   planning/    memory per rank before running, torch-free arithmetic from a model config            ch. 01, 03
   step_memory  one real optimizer step's memory in the planner's terms; the QLoRA ladder of such steps ch. 01
   launch/      a typed launch spec written as torchrun, sbatch and Kubernetes files; one process     ch. 02-06
                runner every launcher uses (python -m distlab.launch regenerate|check)
5. workers/     programs inside torchrun ranks, and their launcher                                    ch. 00, 05
   lan/         heterogeneous LAN clusters emulated on one machine   (python -m distlab.lan ...)        ch. 05
   slurm/       a real Slurm cluster on one machine                  (python -m distlab.slurm ...)      ch. 06
   inference/   pipeline inference by decoder layers with a KV cache (python -m distlab.inference)   ch. 06
   pipeline_sweeps  the measured pipeline sweeps chapter 04 and the benchmarks run: the bubble against
                micro-batches and schedule, the study's table, the pipeline against FSDP            ch. 04
   lessons      what chapters share below them: a split run's devices, dtypes and loss tolerance, its
                losses against one device, Megatron's bytes per layer, the diagrams' colours      ch. 07, 08
6. chapters/    each chapter's plumbing: sweeps, tables, figures its notebook calls
   bench/       benchmarks that print ratios measured side by side
   commands/    the commands a user runs on run folders: plan, matrix, monitor, scaling, report, infer, accept;
                each is `python -m distlab <name>` (__main__.py, the one entry point: `python -m distlab --help`)
   publish/     the maintainers' tools: regenerate the notebooks, build and check the book, the dataset
"""

__version__ = "0.1.0"
