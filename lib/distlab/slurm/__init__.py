"""A real Slurm cluster on one machine (chapter 06): munge, slurmctld and two slurmd nodes (n1, n2, one
port each), everything under build/slurm/, started and stopped by the repository.

  cluster  the cluster's files (slurm.conf, munge key, spool, state, logs) and daemons: up, down,
           status, idempotent; `down` leaves nothing of the cluster's running
  submit   submitting through sbatch, waiting for a job, reading its records back with sacct -c
  local    the same job without Slurm: its run.sh once per task on this machine, as srun would start it, under
           the local process runner (a laptop as a normal user, macOS), with a record shaped like sacct's
  command  the command line below

      python -m distlab.slurm up|down|status
"""
