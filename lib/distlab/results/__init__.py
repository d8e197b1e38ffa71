"""Results (chapters 02-04): one schema for a run, what every rank records, reading it back from logs
alone, and the tables built from it. Read `schema` first: every table's columns are its names.

  schema            the one vocabulary (COLUMNS, WARMUP_STEPS), the summary of a run from its step
                    records (tokens/s, slowest-rank step time, efficiency, comm share, peak bytes), and
                    MemoryBreakdown: the bytes a rank holds, planned or measured                       ch. 02
  recorder          what every rank prints at the end of a run: its result JSON between markers      ch. 03
  extract           the markers read back from any log, strictly (truncated, doubled, missing: errors) ch. 03
  scaling_table     step logs -> chapter 02's scaling table and plots                                  ch. 02
  benchmark_report  result records -> the strategy table, plots and BENCHMARK_REPORT.md, loss curves ch. 03
"""
