"""hmmprompt: head and prompt tuning on HMM-pretrained masked LMs (Wei, Xie
& Ma, NeurIPS 2021) in JAX/Flax. Modules are imported by name (``from
hmmprompt import hmm``): ``import hmmprompt`` alone imports nothing else."""

from importlib import metadata as _metadata

try:
  __version__ = _metadata.version("hmmprompt")
except _metadata.PackageNotFoundError:  # a checkout on sys.path, uninstalled
  __version__ = "0+unknown"
