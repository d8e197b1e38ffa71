"""The commands a user runs on run folders (the enterprise demo's tools, and the benchmark's report), each
`python -m distlab <name>` with `--help` (distlab/__main__.py, also the `distlab` console script, runs them;
`python -m distlab --help` lists them); bad input ends with one line and exit 2.

  plan     a training config's memory plan per GPU and the LAN cluster guide's advice, before running
  matrix   the strategy x world-size matrix, run locally with the generated torchrun scripts
  monitor  device utilisation around any command: GPUs, or CPU % and RSS of each process it starts
  scaling  step logs of several run folders -> the scaling table, csv/md/png
  report   result markers in logs (run folders, kubectl logs) -> metrics csv, plots, BENCHMARK_REPORT.md
  infer    answers before and after a LoRA adapter; key-fact accuracy when the prompts carry facts
  accept   the enterprise demo's acceptance checks over run folders (exit 1 naming each failed check)

Each module holds a `main(argv)` and a docstring whose first line is its entry in the listing; a new one is
registered in distlab.__main__.COMMANDS.
"""
