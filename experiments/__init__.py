"""The binaries (``python -m experiments.<name>``), run from a checkout; each
imports this package first, which keeps JAX's TPU probe out of their logs."""

import logging

# Drops JAX's "Unable to initialize backend 'tpu': ... libtpu.so", logged like
# an error at every start without libtpu; any other failure is still logged.
logging.getLogger("jax._src.xla_bridge").addFilter(lambda record: not (
    (msg := record.getMessage()).startswith(
        "Unable to initialize backend 'tpu'") and "libtpu.so" in msg))

from absl import app as _app

# absl ends --help / --helpfull with status 1, as if it failed; help that was
# asked for ends with 0 (parse errors keep theirs).
for _cls in (_app.HelpFlag, _app.HelpfullFlag):
  def _parse_then_exit_0(self, arg, parse=_cls.parse):
    try:
      parse(self, arg)
    except SystemExit:
      raise SystemExit(0) from None
  _cls.parse = _parse_then_exit_0
