"""In-context learning on GINC (docs/icl.md): the exact mixture of GINC's
concepts and causal transformers pretrained on its text, on GINC's prompts.

  python -m experiments.icl --preset=cpu --workdir=DIR

Often set: --config.seeds, --config.lengths, --config.examples,
--config.prompts, --config.smoothings; --helpfull lists all of them.
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
