"""Measurement (chapters 00-04, 07): everything that watches a run from outside the training code.

  envcheck        what is installed, what hardware is there, and whether every rank agrees   ch. 00
  limits          this machine's matmul FLOP/s, memory bandwidth, all-reduce bus bandwidth   ch. 00
  utilisation     a device-utilisation timeline (GPU util, or CPU % and RSS) around any run  ch. 00, 02
  meter           the one meter the training loop reads, and the hooks strategies call        ch. 02
  comm            communication time: DDP's comm hook, every torch.distributed collective    ch. 02-03
  collectives     counting collectives and their bytes, DTensor's included (a dispatch mode) ch. 07
  ddp_trace       one DDP step under torch.profiler: bucket all-reduces against backward      ch. 02
  fsdp_trace      FSDP2 steps under torch.profiler: all-gathers, reduce-scatters vs compute  ch. 03
  chrome_trace    reading a profiler's chrome trace into spans (ddp_trace, fsdp_trace)        ch. 02-03
  state           bytes of weights, adapters, gradients, optimizer state a rank really holds ch. 01, 03
  pipeline_trace  per-micro-batch timeline of both pipelines, transfers, activation memory   ch. 04
  bubble          the bubble in theory and as read from a recorded timeline (pure functions) ch. 04
"""
