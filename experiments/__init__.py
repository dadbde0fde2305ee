"""The binaries (``python -m experiments.<name>``), run from a checkout; each
imports this package first, which keeps JAX's TPU probe out of their logs."""

import logging

# Drops JAX's "Unable to initialize backend 'tpu': ... libtpu.so", logged like
# an error at every start without libtpu; any other failure is still logged.
logging.getLogger("jax._src.xla_bridge").addFilter(lambda record: not (
    (msg := record.getMessage()).startswith(
        "Unable to initialize backend 'tpu'") and "libtpu.so" in msg))
