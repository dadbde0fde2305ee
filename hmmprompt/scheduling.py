"""Which of a run's stacks this process runs, in which order, until when
(:class:`Schedule`, for :func:`hmmprompt.protocol.run_stacks`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


class Schedule(NamedTuple):
  """How a run shares and bounds its stacks (any hashable keys).

  Attributes:
    num_hosts: hosts sharing the stacks (a SLURM array), each running every
      ``num_hosts``-th.
    host_index: this host's index in ``[0, num_hosts)``.
    claim: ``claim(stack)``, asked as a stack starts; a refused stack is
      another process's (``hmmprompt.figure3.workers``). With it every
      stack is this process's to claim, the costliest first.
    deadline: a ``time.monotonic()`` value after which no stack starts (one
      started is finished).
    stop_at: a hard deadline (monotonic): no stack starts that its estimate
      does not finish by then (a part may: ``run_stacks``' ``split``), the
      cheapest first without ``claim`` (a short stretch still lands whole
      stacks); it stops a run between two tuning groups or training steps.
    seconds_per_weight: the estimate's seconds per unit of a stack's
      weight until the run has timed a stack of its own.
    tune_seconds_per_trial: the estimate's tuning seconds per trial: a stack
      whose pretraining ends too late for its tuning to end by ``stop_at``
      saves it first where it writes no checkpoint otherwise
      (``hmmprompt.pretrain.CHECKPOINTS``' ``deadline``).
    progress: with ``claim``, ``progress(key)`` records a tuning group this
      process finished (``key`` unique in the run) and returns ``(groups
      all processes sharing the claims finished, how many share them)``,
      for progress lines over the whole run and a shared estimate
      (``hmmprompt.figure3.workers.progress``); without it a claiming
      process counts its own groups, with no estimate.
  """

  num_hosts: int = 1
  host_index: int = 0
  claim: Callable[[Any], bool] | None = None
  deadline: float | None = None
  stop_at: float | None = None
  seconds_per_weight: float | None = None
  tune_seconds_per_trial: float | None = None
  progress: Callable[[str | None], tuple[int, int]] | None = None

  def check(self) -> Schedule:
    """Returns itself; ``ValueError`` naming a bad host shard."""
    if self.num_hosts < 1 or not 0 <= self.host_index < self.num_hosts:
      raise ValueError(f"host_index {self.host_index} not in [0, "
                       f"{self.num_hosts}) (num_hosts {self.num_hosts}; the "
                       f"binaries' --task_index and --num_tasks)")
    return self

  def mine(self, stacks: Sequence, cost: Callable[[Any], Any]) -> list:
    """This process's ``stacks`` in its order: every one, costliest first, to
    claim; else every ``num_hosts``-th, cheapest first under ``stop_at``."""
    self.check()
    if self.claim is not None:  # the long stacks first: no long one last
      return sorted(stacks, key=cost, reverse=True)
    ordered = sorted(stacks, key=cost) if self.stop_at is not None else stacks
    return [s for i, s in enumerate(ordered)
            if i % self.num_hosts == self.host_index]


EVERYTHING = Schedule()
"""The default: every stack, in plan order, with no deadline."""
