"""Data parallelism with jax.sharding: one mesh axis over all devices (of
every process after ``jax.distributed.initialize``; docs/multihost.md)."""

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

DATA = "data"


def data_mesh() -> Mesh:
  return Mesh(np.asarray(jax.devices()), (DATA,))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def trial_batch_sharded(mesh: Mesh) -> NamedSharding:
  """``[K, B, ...]``: trials replicated, the batch split over the devices."""
  return NamedSharding(mesh, P(None, DATA))


def step_trial_batch_sharded(mesh: Mesh) -> NamedSharding:
  """``[N, K, B, ...]``: steps and trials replicated, the batch split."""
  return NamedSharding(mesh, P(None, None, DATA))


def check_batch(batch_size: int, mesh: Mesh) -> None:
  if batch_size % (n := mesh.devices.size):
    raise ValueError(f"batch size {batch_size} is not divisible by the "
                     f"{n} devices of the data-parallel mesh")


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None) -> None:
  """``jax.distributed.initialize`` with the settings given, the rest
  auto-detected (SLURM, Open MPI, TPU VMs); before any JAX computation.
  ``ValueError``: bad values, or too few (the message says which to pass)."""
  given = (coordinator_address, num_processes, process_id)
  try:
    jax.distributed.initialize(*given)
  except ValueError as e:
    hint = ("" if None not in given else " (no SLURM, Open MPI or TPU "
            "environment was detected to fill in the rest: pass "
            "--coordinator_address, --num_processes and --process_id)")
    raise ValueError(f"--distributed: {e}{hint}") from e


# Dense peak TFLOP/s by (device kind substring, dtype), from vendor specs.
PEAK_TFLOPS = {("H100", "bfloat16"): 989.0, ("H100", "float32"): 494.5,
               ("H200", "bfloat16"): 989.0, ("H200", "float32"): 494.5,
               ("A100", "bfloat16"): 312.0, ("A100", "float32"): 156.0}


def peak_tflops(dtype: str, override: float | None = None) -> float | None:
  """``override``, else the GPU's :data:`PEAK_TFLOPS` for ``dtype``, or None."""
  if override is not None:
    return override
  if jax.default_backend() != "gpu":
    return None
  kind = jax.devices()[0].device_kind
  return next((peak for (name, dt), peak in PEAK_TFLOPS.items()
               if name in kind and dt == dtype), None)
