"""In-context learning on GINC, exact and pretrained (docs/icl.md).
  python -m experiments.icl --preset=cpu --workdir=DIR
Every setup field is a --config.<path> flag; --helpfull lists them.
"""

from absl import app
from absl import flags

from experiments import cli
from hmmprompt import icl

main = cli.study_main(icl, icl.run_icl, icl.write_report,
                      results="icl.jsonl", table="icl.md", plot="icl.png")
flags.adopt_module_key_flags(cli)
if __name__ == "__main__":
  app.run(main)
