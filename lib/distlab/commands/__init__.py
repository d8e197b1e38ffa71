"""The commands a user runs on run folders (the enterprise demo's tools, and the benchmark's report),
each `python -m distlab.<name>` with `--help`; bad input ends with one line and exit 2.

  infer    answers before and after a LoRA adapter; key-fact accuracy when the prompts carry facts
  scaling  step logs of several run folders -> the scaling table, csv/md/png
  report   result markers in logs (run folders, kubectl logs) -> metrics csv, plots, BENCHMARK_REPORT.md
  matrix   the strategy x world-size matrix, run locally with the generated torchrun scripts
  accept   the enterprise demo's acceptance checks over run folders (exit 1 naming each failed check)
  monitor  device utilisation around any command: GPUs, or CPU % and RSS of each process it starts
  plan     a training config's memory plan per GPU and the LAN cluster guide's advice, before running
           (`python -m distlab.commands.plan --config ...`; no short alias)

`python -m distlab.infer` runs distlab.commands.infer (each name above has such a one-line alias).
"""
