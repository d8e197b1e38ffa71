"""Launching (chapters 02-06): a typed spec written out as torchrun scripts and Kubernetes resources, a
runner that never leaves orphans, and jobs that run a training launch locally the way a cluster would.

  spec       LaunchSpec: what to run, on how many nodes and processes, validated field by field
  torchrun   the spec written as bash scripts that run torchrun (+ a README per multi-node folder);
             torchrun_flags, the one builder of torchrun's flags
  generated  writing, checking and regenerating a folder of generated files
  seeds      the repository's launch/ folder (the enterprise demo's SEED_MATRIX, the Kubernetes
             benchmark's KUBE_MATRIX) and the CLI:

                 python -m distlab.launch regenerate|check

  runner     run a job in its own process group: output streamed, hard timeout, nothing left behind
  jobs       write a training launch to build/launch/ and run it (what the notebooks call)
  network    network presets by name (lan-ethernet, cloud-no-rdma, rdma-infiniband): NCCL/gloo
             variables with a reason each, from network_presets.yaml; LaunchSpec(network=...)
  kubernetes the spec as Kubernetes resources: Namespace, headless Service, one Indexed Job per
             run (launch/k8s/, from seeds.KUBE_MATRIX)
  kubepod    the pod's side: its entrypoint (node rank from JOB_COMPLETION_INDEX, bounded DNS wait,
             the same torchrun command) and the image's Dockerfile
  kubecheck  offline validation: strict schemas of two Kubernetes versions + checks the schema
             cannot see          (python -m distlab.launch.k8s validate FILES...)
  kubecollect  a run's results from its pods' logs through kubectl
                                 (python -m distlab.launch.k8s collect --run NAME)
"""

from distlab.launch.generated import GENERATED_MARK, check_dir, regenerate
from distlab.launch.network import NetworkPresetError, preset_names
from distlab.launch.seeds import KUBE_MATRIX, SEED_MATRIX, kube_files, kube_job, main, seed_files, seed_spec
from distlab.launch.spec import LaunchSpec, LaunchSpecError
from distlab.launch.torchrun import render_files, render_script, torchrun_flags, write_scripts
from distlab.strategies import PIPELINE_STRATEGIES

__all__ = ["GENERATED_MARK", "KUBE_MATRIX", "PIPELINE_STRATEGIES", "SEED_MATRIX", "LaunchSpec", "LaunchSpecError",
           "NetworkPresetError", "check_dir", "kube_files", "kube_job", "main", "preset_names", "regenerate",
           "render_files", "render_script", "seed_files", "seed_spec", "torchrun_flags", "write_scripts"]
