"""hmmprompt: head and prompt tuning on HMM-pretrained masked LMs (Wei, Xie
& Ma, NeurIPS 2021) in JAX/Flax. The modules are imported by name
(``from hmmprompt import hmm``); importing the package imports nothing
else, so ``import hmmprompt`` stays cheap."""

from importlib import metadata as _metadata

try:
  __version__ = _metadata.version("hmmprompt")
except _metadata.PackageNotFoundError:  # a checkout on sys.path, uninstalled
  __version__ = "0+unknown"
