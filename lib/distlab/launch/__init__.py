"""Launching (chapters 02-06): a typed spec written out as torchrun scripts, a runner that never
leaves orphans, and jobs that run a training launch locally the way a cluster would.

  spec       LaunchSpec: what to run, on how many nodes and processes, validated field by field
  torchrun   the spec written as bash scripts that run torchrun (+ a README per multi-node folder);
             torchrun_flags, the one builder of torchrun's flags
  generated  writing, checking and regenerating a folder of generated files
  seeds      the repository's launch/ folder (the enterprise demo's SEED_MATRIX) and the CLI:

                 python -m distlab.launch regenerate|check

  runner     run a job in its own process group: output streamed, hard timeout, nothing left behind
  jobs       write a training launch to build/launch/ and run it (what the notebooks call)
"""

from distlab.launch.generated import GENERATED_MARK, check_dir, regenerate
from distlab.launch.seeds import SEED_MATRIX, main, seed_files, seed_spec
from distlab.launch.spec import LaunchSpec, LaunchSpecError
from distlab.launch.torchrun import render_files, render_script, torchrun_flags, write_scripts
from distlab.strategies import PIPELINE_STRATEGIES

__all__ = ["GENERATED_MARK", "PIPELINE_STRATEGIES", "SEED_MATRIX", "LaunchSpec", "LaunchSpecError", "check_dir",
           "main", "regenerate", "render_files", "render_script", "seed_files", "seed_spec", "torchrun_flags",
           "write_scripts"]
