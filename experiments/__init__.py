"""The binaries (``python -m experiments.<name>``), run from a checkout.

Every binary imports this package first, so what all of them share about
the process's output is set here: JAX's probe for a TPU is kept out of
their logs (:class:`_NoTpuProbe`).
"""

import logging


class _NoTpuProbe(logging.Filter):
  """Drops JAX's ``Unable to initialize backend 'tpu': ... Failed to open
  libtpu.so ...``: without libtpu installed, JAX probes for it at every
  backend start and logs the miss at INFO, which absl's handler (the
  binaries' ``app.run``) prints on every CPU run, like an error. Only that
  miss is dropped: a TPU whose libtpu loads but fails, or any other
  backend that fails (a CUDA plugin without a GPU), is still logged, and
  an accelerator present is still used (nothing here picks a platform)."""

  def filter(self, record: logging.LogRecord) -> bool:
    msg = record.getMessage()
    return not (msg.startswith("Unable to initialize backend 'tpu'")
                and "libtpu.so" in msg)


logging.getLogger("jax._src.xla_bridge").addFilter(_NoTpuProbe())
