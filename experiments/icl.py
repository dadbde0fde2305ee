"""In-context learning on GINC, exact and pretrained (docs/icl.md).
  python -m experiments.icl --preset=cpu --workdir=DIR
Every setup field is a --config.<path> flag; --helpfull lists them.
"""

from absl import app
from absl import flags

from experiments import cli
from hmmprompt import icl

# One malloc arena: the step's 1.6 GiB of temporaries (docs/performance.md).
main = cli.study_main(icl, icl.run_icl, icl.write_report, one_arena=True,
                      results="icl.jsonl", table="icl.md", plot="icl.png")
flags.adopt_module_key_flags(cli)
if __name__ == "__main__":
  app.run(main)
