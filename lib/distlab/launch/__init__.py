"""Launching (chapters 02-06): a typed spec written out as scripts, and one way to run a process group.
Importing this package loads nothing; import the module you need.

  spec        LaunchSpec: what to run, on how many nodes and processes, validated field by field
  network     network presets by name (lan-ethernet, cloud-no-rdma, rdma-infiniband): NCCL/gloo
              variables with a reason each, from network_presets.yaml; LaunchSpec(network=...);
              loopback_ifname, this machine's loopback interface (lo, lo0 on macOS)
  shell       the one way every writer here refuses or quotes a value: control characters, length,
              the secret rule for names and values, shell quoting; SpecError, the errors' base
  process     run a command in its own process group: output streamed, hard timeout, the whole
              tree killed (subreaper), nothing left behind; what every launcher here runs through
  watchdog    the hard limit every generated torchrun script runs its job under: GNU `timeout
              --kill-after`'s contract in Python (macOS has no `timeout`), killing through process
  generated   writing, checking and regenerating a folder of generated files
  torchrun    the spec written as bash scripts that run torchrun (+ a README per multi-node folder);
              torchrun_flags, the one builder of torchrun's flags
  sbatch      the spec written as a Slurm batch script (submit.sbatch + run.sh), container or not
  local       write a training launch to build/launch/ and run it on this machine (what notebooks call),
              refused first when it asks for more GPU ranks than there are visible GPUs
  scripts     a chapter's script run under torchrun on local gloo ranks (through process), and the
              JSON its rank 0 printed after `RESULT ` read back (run_script: what notebooks call)
  catalog     the repository's launch/ folder (the enterprise demo's DEMO_MATRIX, the Kubernetes
              benchmark's KUBE_MATRIX) and its command:

                  python -m distlab.launch regenerate|check

  kubernetes/ the spec as Kubernetes resources, the pods' entrypoint, offline checks, collection:

                  python -m distlab.launch.kubernetes validate|collect

  k8s         the same command under the name earlier READMEs used (python -m distlab.launch.k8s)
"""
