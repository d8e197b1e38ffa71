"""The launch spec as Kubernetes resources (the strategy benchmark on a cluster, appendix): importing the
package loads nothing.

  manifests  Namespace, headless Service and one Indexed Job per run, written as YAML (launch/k8s/,
             from catalog.KUBE_MATRIX); KubeJob validates every field
  pod        the pod's side: its entrypoint (node rank from JOB_COMPLETION_INDEX, bounded DNS wait,
             the same torchrun command) and the image's Dockerfile
  checks     offline validation: strict schemas of two Kubernetes versions + checks the schema cannot see
  collect    a run's results from its pods' logs through kubectl
  command    the command line:

                 python -m distlab.launch.kubernetes validate FILES... | collect --run NAME
"""
