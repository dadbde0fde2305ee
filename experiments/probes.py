"""Where the posterior lives: probes of the residual stream (docs/probes.md).
  python -m experiments.probes --preset=cpu --workdir=DIR
Every setup field is a --config.<path> flag; --helpfull lists them.
"""

from absl import app
from absl import flags

from experiments import cli
from hmmprompt import probing

# One malloc arena: GINC's pretraining step (docs/performance.md).
main = cli.study_main(probing, probing.run_probes, probing.write_report,
                      one_arena=True, results="probes.jsonl",
                      table="probes.md", simplex="mess3_simplex.png")
flags.adopt_module_key_flags(cli)
if __name__ == "__main__":
  app.run(main)
