"""The result line (:class:`ResultLine`): one typed record per (backbone,
arm, size, trial, task), written, keyed for resume and read back by it."""

import dataclasses
import os

from hmmprompt import files as files_lib


@dataclasses.dataclass(frozen=True)
class ResultLine(files_lib.Line):
  """One finished cell of the sweep, keyed by ``KEY_FIELDS`` (``setup``:
  :meth:`configs.Setup.fingerprint`); ``pretrain_*``: ``None`` for exact."""

  backbone: str  # exact | transformer
  panel: str  # left | right
  hmm: str  # vanilla | memory
  num_states: int  # |H| (syntax states for memory)
  memory_size: int  # 0 for vanilla
  trial: int  # the HMM draw
  task: int  # the downstream draw on it
  method: str  # <method>_<head>
  features: str
  setup: str
  hmm_fingerprint: str  # generative.model_fingerprint
  size: int  # the x-axis: |H| (left) or |M||H| (right)
  test_accuracy: float
  val_accuracy: float
  train_accuracy: float
  final_loss: float
  steps: int
  seconds: float
  task_redraws: int
  assumptions: dict
  tune_config: dict
  task_config: dict
  pretrain_ce_gap: float | None = None
  pretrain_tv: float | None = None
  pretrain_mlm_ce: float | None = None
  pretrain_bayes_ce: float | None = None
  pretrain_steps: int | None = None
  pretrain_wall_s: float | None = None
  pretrain_layers: int | None = None  # the fallback's depth if it fell back
  # [a, b): pretrained with trials a..b-1 alone, a part of the stack (a run
  # cut short for time); absent from the file where the whole stack was.
  pretrain_part: list[int] | None = None
  trainable_params: int | None = None  # head included; absent in old lines

  KEY_FIELDS = ("backbone", "panel", "hmm", "num_states", "memory_size",
                "trial", "task", "method", "features", "setup")

  def to_json(self) -> dict:
    d = super().to_json()
    for name in ("pretrain_part", "trainable_params"):  # absent where None,
      if d[name] is None:  # as in every line before the field existed
        del d[name]
    return d

  @property
  def summary_key(self) -> tuple:
    """One curve of the figure: (backbone, panel, hmm, method, features)."""
    return (self.backbone, self.panel, self.hmm, self.method, self.features)


def results_path(workdir: str, num_hosts: int = 1, host_index: int = 0):
  """Each host of a sharded sweep writes its own file."""
  return os.path.join(workdir, "results.jsonl" if num_hosts == 1 else
                      f"results-{host_index:05d}-of-{num_hosts:05d}.jsonl")


def read_results(workdir: str) -> list[ResultLine]:
  """Lines of every results file in ``workdir`` (hosts write their own)."""
  return files_lib.read_lines(os.path.join(workdir, "results*.jsonl"),
                              ResultLine)


def check_one_setup(lines, where: str) -> None:
  """``ValueError`` naming ``where`` if a backbone's lines mix setups."""
  by_backbone: dict[str, set] = {}
  for r in lines:
    by_backbone.setdefault(r.backbone, set()).add(r.setup)
  for backbone, fps in sorted(by_backbone.items()):
    if len(fps) > 1:
      raise ValueError(
          f"{where}: {backbone} lines of setups {sorted(fps)}; one results "
          f"directory holds one setup per backbone (a changed config moves "
          f"the fingerprint): use another --workdir for the new setup")
