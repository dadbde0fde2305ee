r"""GINC's released HMMs, converted from GINC's own repository files.

  python -m experiments.ginc_release --source=DIR [--out=ginc_hmms.npz]

DIR: p-lambda/incontext-learning at 84fab21, ``data/GINC_trans0.1_start10.0_
nsymbols50_nvalues10_nslots10_vic0.9_nhmms10/`` (its ``*.pkl``); then run
``experiments.icl --config.concepts=released --config.released_path=OUT``.
"""

from absl import app
from absl import flags

from experiments import cli
from hmmprompt import ginc

_SOURCE = flags.DEFINE_string("source", None, "GINC's data directory")
_OUT = flags.DEFINE_string("out", "ginc_hmms.npz", "the converted file")


@cli.one_line_errors
def main(argv):
  t0 = cli.start(argv, source=_SOURCE.value)
  with cli.usage_errors():
    ginc.convert_release(_SOURCE.value, _OUT.value)
  cli.done(t0, released=_OUT.value)


if __name__ == "__main__":
  app.run(main)
