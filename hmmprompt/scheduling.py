"""Which of a run's stacks this process runs, in which order, until when.

One argument, :class:`Schedule`, for the three ways a list of stacks is
shared and bounded; any run of stacks (:func:`hmmprompt.protocol.run_stacks`:
Figure 3's sweep, the pretraining curve) takes it:

* host shards (``num_hosts``, ``host_index``): each host runs every
  ``num_hosts``-th stack, in plan order (a SLURM array);
* claims (``claim``): processes sharing a machine each take the next stack
  nobody has claimed, the costliest first (``hmmprompt.figure3.workers``);
* a deadline (``deadline``, ``stop_at``, ``seconds_per_weight``): a lent
  machine's time; with ``stop_at`` the cheapest stacks run first, so that
  a short stretch of time still lands whole stacks (chunks).

No science here: a stack is any hashable key and its cost any number.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


class Schedule(NamedTuple):
  """How a run shares and bounds its stacks (the defaults: all of them, in
  plan order, with no deadline).

  Attributes:
    num_hosts: hosts sharing the stacks by index.
    host_index: this host's index in ``[0, num_hosts)``.
    claim: ``claim(stack)`` asked just before a stack starts; a refused
      stack is another process's. With it every stack is this process's to
      claim (no host shards), the costliest first.
    deadline: a ``time.monotonic()`` value: no stack starts after it, and a
      stack started is finished.
    stop_at: a hard deadline (monotonic): no stack starts that its estimate
      does not finish by then, and a run stops between two tuning groups
      or training steps when it comes.
    seconds_per_weight: the estimate's seconds per unit of a stack's
      weight before the run has timed a stack of its own.
  """

  num_hosts: int = 1
  host_index: int = 0
  claim: Callable[[Any], bool] | None = None
  deadline: float | None = None
  stop_at: float | None = None
  seconds_per_weight: float | None = None

  def check(self) -> Schedule:
    """Returns itself; ``ValueError`` naming a bad host shard."""
    if self.num_hosts < 1 or not 0 <= self.host_index < self.num_hosts:
      raise ValueError(f"host_index {self.host_index} not in [0, "
                       f"{self.num_hosts}) (num_hosts {self.num_hosts}; the "
                       f"binaries' --task_index and --num_tasks)")
    return self

  def mine(self, stacks: Sequence, cost: Callable[[Any], Any]) -> list:
    """This process's stacks of ``stacks`` (in plan order), in the order it
    runs them: every one, costliest first, to claim; every
    ``num_hosts``-th otherwise, cheapest first under ``stop_at``."""
    self.check()
    if self.claim is not None:  # the long stacks first: no long one last
      return sorted(stacks, key=cost, reverse=True)
    ordered = sorted(stacks, key=cost) if self.stop_at is not None else stacks
    return [s for i, s in enumerate(ordered)
            if i % self.num_hosts == self.host_index]


EVERYTHING = Schedule()
"""The default: every stack, in plan order, with no deadline."""
