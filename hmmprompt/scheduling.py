"""Which of a run's stacks this process runs, in which order, until when
(:class:`Schedule`, for :func:`hmmprompt.protocol.run_stacks`)."""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


class Schedule(NamedTuple):
  """How a run shares and bounds its stacks (any hashable keys; every field
  in detail: docs/figure3.md, "Many machines"). ``claim(stack)``, asked as
  each stack starts, costliest first, is False for another process's
  (``hmmprompt.figure3.workers``); ``progress(key)`` records a group this
  process finished and returns ``(groups all processes finished, count)``."""

  num_hosts: int = 1  # hosts of a SLURM array sharing stacks round-robin
  host_index: int = 0  # this host's, in ``[0, num_hosts)``
  claim: Callable[[Any], bool] | None = None
  deadline: float | None = None  # ``time.monotonic()``: no stack starts after
  stop_at: float | None = None  # hard: a run stops between groups or steps
  seconds_per_weight: float | None = None  # the estimate until a stack ran
  tune_seconds_per_trial: float | None = None  # the estimate's tuning part
  progress: Callable[[str | None], tuple[int, int]] | None = None  # w/ claim

  def check(self) -> "Schedule":
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
    return list(ordered[self.host_index::self.num_hosts])

  def progress_line(self, key: str, done: int, total: int, elapsed: float
                    ) -> tuple[str, str]:
    """A progress line's count and timing after this process's ``done``-th
    group ``key`` of ``total``, ``elapsed`` seconds in (``run_stacks``)."""
    if self.claim is None:
      return (f"[{done}/{total} groups]", f"elapsed {elapsed:.0f}s, ETA "
              f"{elapsed / done * (total - done):.0f}s")
    if self.progress is None:
      return f"[{done} done here, of the run's {total} groups]", (
          f"elapsed {elapsed:.0f}s")
    finished, processes = self.progress(key)
    total = max(total, finished)  # one finished while this process planned
    # This process's seconds per group, the groups left shared between all.
    eta = elapsed / done * max(total - finished, 0) / max(processes, 1)
    return (f"[{finished}/{total} groups, all workers]",
            f"elapsed {elapsed:.0f}s, ETA {eta:.0f}s")


EVERYTHING = Schedule()
"""The default: every stack, in plan order, with no deadline."""
