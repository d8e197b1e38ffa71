"""Pipeline inference (chapter 06): a decoder-only LM cut into N stages by decoder layers, each stage a
process that loads only its own weights, generating with a per-stage KV cache while several
micro-batches of prompts are in flight, so every stage works at the same time.

  stage_weights  read only the tensors a stage needs from a safetensors checkpoint (single file or
              sharded), and merge a PEFT LoRA adapter's deltas for those layers into them
  stage       InferenceStage: [embeddings] -> layers[i:j] -> [norm, LM head], built empty and
              filled from the checkpoint; one forward with the stage's KV cache
  batches     prompts -> chat-templated, left-padded micro-batches (the same rows on every rank)
  engine      the pipelined generation loop over torch.distributed (hidden states forward,
              sampled tokens back), greedy or seeded temperature/top-p, stop at EOS or max tokens
  resume      completions that survive a lost stage: appended and fsynced one micro-batch at a time,
              a torn last line dropped, the answered prompts skipped when the job is resubmitted
  outputs     a finished run read back: summary, completions, per-stage timeline and memory
  run         the per-rank entry point (torchrun or srun): rank/world from the environment, per-rank
              log, completion JSONL, per-stage memory and timeline; --resume finishes a lost job
  tp_decode   the other way to split a model for decoding (chapter 08): every rank a slice of every
              layer (tensor parallelism), all ranks on the same tokens, with transformers' generate

                  python -m distlab.inference --out-dir DIR [--stages-from-world] ...
"""
