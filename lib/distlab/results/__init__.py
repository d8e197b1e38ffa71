"""Results (chapters 02-04): one schema for a run, the scaling table, and the collector that reads
results back from logs alone. Read `schema` first: every table's columns are its names.

  schema   the one vocabulary (COLUMNS, WARMUP_STEPS) and the summary of a run from its
           step records: tokens/s, slowest-rank step time, efficiency, comm share, peak bytes   ch. 02
  report   step logs -> chapter 02's scaling table and plots; the all-reduce cost model          ch. 02
  collect  result JSON between markers in every rank's log, a strict extractor, the strategy
           table, plots and BENCHMARK_REPORT.md, the planner and loss-curve comparisons          ch. 03
"""
