"""Benchmarks: each prints ratios measured side by side in one run (alternating rounds, median and spread),
never absolute targets. Each is `python -m distlab.bench.<name>` with `--help`.

  trainer_vs_hf       distlab's loop vs HF Trainer (fp32 and bf16) vs TRL SFTTrainer, one thread each,  ch. 01
                      and the recipe ablation (--out: the tables of book/appendix_benchmarks.md)
  compiled_step       the LoRA step, each decoder block compiled vs eager, one thread; compile seconds   CPU
  mfu_ladder          full fine-tuning tokens/s and MFU on one GPU, one optimisation added per rung      GPU
  ddp_scaling         2-rank DDP efficiency against 1 rank                                              ch. 02
  memory_recipes      the QLoRA ladder (bf16 LoRA, nf4 base, 8-bit AdamW, checkpointing): bytes measured   ch. 01
                      vs planned per component, tokens/s against bf16 LoRA
  scale_rehearsal     every strategy for 2 steps of the 0.5B shape on 2 CPU ranks: each rank's memory at  ch. 03
                      load and in a step against the planner's (distlab.planning.load), not timed
  tensor_parallel     2-rank tensor parallelism (tp) against one device, full fine-tuning               ch. 07
  pipeline_bubble     the measured pipeline bubble vs its formula, 1F1B and interleaved 1F1B              ch. 04
  pipeline_study      the pipeline-vs-FSDP study's effective-token sweep toward ~100k tokens per step     ch. 04
  pipeline_inference  2 stages with micro-batches in flight vs 1 stage vs one at a time                  ch. 06
  lan_network         all-reduce bus bandwidth as a share of a shaped link                               ch. 05
  lan_balance         uneven micro-batches vs the equal split with one host slower                       ch. 05
  lan_ddp             DDP step time and comm share vs link rate; gradient compression hooks              ch. 05
  lan_pipeline        pipeline layers per stage from measured layer times vs the equal split             ch. 05
"""
