"""Data parallelism with jax.sharding: one mesh axis over all devices.

``jax.devices()`` lists the devices of every process, so after
``jax.distributed.initialize`` the mesh spans all hosts: each process
computes its devices' share of the batch and the gradients are summed
across processes (gloo on CPU; docs/multihost.md).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

DATA = "data"


def data_mesh() -> Mesh:
  return Mesh(np.asarray(jax.devices()), (DATA,))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over the devices."""
  return NamedSharding(mesh, P(DATA))


def trial_batch_sharded(mesh: Mesh) -> NamedSharding:
  """``[K, B, ...]`` stacked trials: the trial axis replicated, the batch
  axis split over the devices."""
  return NamedSharding(mesh, P(None, DATA))


def check_batch(batch_size: int, mesh: Mesh) -> None:
  n = mesh.devices.size
  if batch_size % n:
    raise ValueError(f"batch size {batch_size} is not divisible by the "
                     f"{n} devices of the data-parallel mesh")
