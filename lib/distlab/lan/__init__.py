"""Heterogeneous LAN clusters on one machine (chapter 05): emulated hosts, uneven devices, failures.

  cgroups    per-host CPU share (cfs quota) and memory cap (cgroup v1), their cleanup, and the
             SIGSTOP/SIGCONT duty-cycle fallback when cgroups are not writable
  hosts      the cluster: network namespaces dl5h<i> on a bridge in dl5sw, links shaped with tc tbf;
             up / down / status, idempotent, with a watchdog so a crashed driver leaves nothing behind
  host_runs  torchrun on the cluster: one agent per host from the per-node scripts distlab.launch
             writes, each run through distlab.launch.process; the localhost fallback; calibration
  calibrate  worker: each rank times forward+backward on its own host; the shares for balancing
  gradcheck  worker: the first step's gradient, to compare uneven per-rank batches with one process
  diagnose   the troubleshooting matrix from real error messages, and the executable checklist
  overflow   a memory cap overflowed by full fine-tuning (OOM kill), then the planner's advice under the same cap
  noderank   a node script started on the wrong host, refused by the script's host check

  python -m distlab.lan up [--rates 1gbit,1gbit,1gbit] | down | status
"""
