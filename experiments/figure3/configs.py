"""The sweep's config tree (:class:`Setup`) and its named presets.

Every number that decides a result line is a field of :class:`Setup`; each
preset states its numbers once, here (the pretraining recipes they name
live in ``hmmprompt/pretrain/config.py``). :func:`get_setup` is the one way
in for the binary, the notebook and the tests; on the command line every
leaf is a ``--config.<path>`` flag.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Mapping

from hmmprompt import config_flags
from hmmprompt import heads
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import tasks as tasks_lib
from hmmprompt import tuning
from hmmprompt import validation

VOCAB = 10
MEMORY_SYNTAX_STATES = 4
# Bumped when the HMM drawn for a given (size, trial, seed) changes, so that
# old result lines are not mistaken for current ones (3: trials).
MODEL_KEYS_VERSION = 3
# TuneConfig fields added after result lines had been written (the head
# optimum, L-BFGS): Setup.fingerprint hashes them only when not at their
# defaults, so the earlier lines' fingerprints stand.
TUNE_FIELDS_ADDED = ("optimizer", "lbfgs_tol", "lbfgs_max_steps",
                     "lbfgs_l2")


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything that decides a result line's value besides its key.

  A trial is one HMM draw of a size, its pretrained backbone and its tasks
  (the paper's protocol: a new HMM, corpus, model and task per trial).

  Attributes:
    trials: HMM draws per size on the left panel (the paper: 20).
    right_trials: HMM draws per size on the right panel (the paper: 5;
      ``None``: ``trials``). A vanilla HMM that both panels use is one
      stack of ``max`` of the two; the right panel reads its first
      ``right_trials``.
    tasks_per_hmm: tasks (downstream draws) per trial; more than one
      separates task noise from HMM noise (the report shows both).
    left_sizes: ``|H|`` of the left panel's vanilla HMMs.
    memory_sizes: ``|M|`` of the right panel's memory HMMs (``|H|`` =
      ``MEMORY_SYNTAX_STATES``) and their vanilla twins of ``|M||H|``.
    features: head feature transforms, each run as its own arm.
    task: downstream data sizes (``tasks.TaskConfig``).
    tune: tuning recipe; ``method``, ``head``, ``features`` and
      ``optimizer`` are set per arm by the sweep (``optimizer`` must stay
      ``"adam"`` here: ``head_optimum`` adds the L-BFGS arms).
    seed: root of every random stream (``sweep.model_key`` and friends).
    pretrain: the transformer's pretraining recipe (unused by ``exact``).
    finetune: add full fine-tuning of the transformer as a third arm.
    prompt_attention: Theorem 4.6's arm: on the right panel, prompt
      tuning with the attention head on each memory HMM (``prompt_attention``
      lines), beside its head tuning.
    head_optimum: add, for every linear-head tuning arm (logistic
      regression on the frozen features: convex), a twin whose head is
      solved to its optimum (``TuneConfig.optimizer = "lbfgs"``, the
      ``tune.lbfgs_*`` settings; lines ``<method>_<head>_lbfgs``): how much
      of head tuning's gap is the paper's 5 epochs of Adam.
    lanes_per_vmap: runtime (changes speed and memory, no result beyond
      float rounding): a group's trials x tasks are tuned this many trials
      at a time (``lax.map`` over vmapped groups, one program); 0 all at
      once; ``None`` (auto) 1 on CPU (fastest there: 32 vs 59 s for 20
      prompt-tuning trials at ``|H|`` = 30, and a twentieth of the
      memory), all on accelerators.
    task_memory_mb: runtime: the bytes (MiB) drawing a size's tasks may
      hold at once (:data:`tasks.MEMORY_BUDGET`); 0 unbounded.
  """

  trials: int
  tasks_per_hmm: int
  left_sizes: tuple[int, ...]
  memory_sizes: tuple[int, ...]
  task: tasks_lib.TaskConfig
  tune: tuning.TuneConfig
  pretrain: pretrain_lib.PretrainConfig
  features: tuple[str, ...] = ("raw", "log")
  seed: int = 0
  finetune: bool = False
  right_trials: int | None = None
  prompt_attention: bool = False
  head_optimum: bool = False
  lanes_per_vmap: int | None = dataclasses.field(
      default=None, metadata=config_flags.RUNTIME)
  task_memory_mb: int = dataclasses.field(
      default=tasks_lib.MEMORY_BUDGET >> 20, metadata=config_flags.RUNTIME)

  def __post_init__(self):
    for name in ("trials", "tasks_per_hmm", "right_trials"):
      v = getattr(self, name)
      if not (v is None and name == "right_trials") and not (
          isinstance(v, int) and v >= 1):
        raise ValueError(f"Setup.{name} must be an int >= 1 (a trial count "
                         f"< 1 runs nothing), got {v!r}")
    validation.require_positive_ints(self, "left_sizes", "memory_sizes")
    for name in ("lanes_per_vmap", "task_memory_mb"):
      v = getattr(self, name)
      if not (v is None and name == "lanes_per_vmap") and not (
          isinstance(v, int) and v >= 0):
        raise ValueError(f"Setup.{name} must be an int >= 0 (0: no bound), "
                         f"got {v!r}")
    if self.tune.optimizer != "adam":
      raise ValueError(
          f"Setup.tune.optimizer is set per arm by the sweep, got "
          f"{self.tune.optimizer!r}: --config.head_optimum=true adds an "
          f"L-BFGS twin of every head-tuning arm")
    bad = [f for f in self.features if f not in heads.FEATURES]
    if bad or not self.features:
      raise ValueError(f"Setup.features must be from {heads.FEATURES}, got "
                       f"{self.features}")

  def fingerprint(self, backbone: str = "exact") -> str:
    """12 hex digits keying result lines to the setup that made them.

    The :data:`TUNE_FIELDS_ADDED` of ``tune`` are hashed only away from
    their defaults: lines written before those fields existed keep their
    fingerprint (their values did not change), and a non-default value
    still moves it. Which arms run (``finetune``, ``prompt_attention``,
    ``head_optimum``) is in each line's key (its method), not here.
    """
    tune = dataclasses.asdict(self.tune)
    defaults = {f.name: f.default
                for f in dataclasses.fields(tuning.TuneConfig)}
    for name in TUNE_FIELDS_ADDED:
      if tune[name] == defaults[name]:
        del tune[name]
    blob = {"task": dataclasses.asdict(self.task), "tune": tune,
            "seed": self.seed, "model_keys": MODEL_KEYS_VERSION}
    if backbone == "transformer":
      blob["pretrain"] = self.pretrain.identity()
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()
                          ).hexdigest()[:12]

  def lane_group(self) -> int | None:
    """``tuning.tune``'s ``lane_group`` (``None``: all lanes at once)."""
    return tuning.lane_group_for(self.lanes_per_vmap)

  def task_memory_budget(self) -> int | None:
    """``tasks.make_tasks``' ``memory_budget`` in bytes (``None``: no
    bound)."""
    return (self.task_memory_mb << 20) or None

  def panel_trials(self, panel: str) -> int:
    """HMM draws per size on ``panel`` (left | right)."""
    if panel == "right" and self.right_trials is not None:
      return self.right_trials
    return self.trials

  def trial_counts(self) -> dict:
    """What a workdir's trial stacks depend on (``sweep.json``)."""
    return {"trials": self.trials,
            "right_trials": self.panel_trials("right")}

  @property
  def input_len(self) -> int:
    """Positions of a prompt-tuning input: prompt, MASK, tokens."""
    return tasks_lib.input_len(self.tune.prompt_len, self.task.seq_len)

  def check_context(self) -> None:
    """``ValueError`` if a prompt-tuning input exceeds the transformer's
    pretrained context."""
    if self.input_len > self.pretrain.model.max_len:
      raise ValueError(
          f"prompt_len + 1 + seq_len = {self.input_len} positions exceed the "
          f"pretrained context of {self.pretrain.model.max_len}; lower "
          f"--config.task.seq_len or --config.tune.prompt_len")


def _tune(epochs: int, prompt_len: int, batch_size: int) -> tuning.TuneConfig:
  return tuning.TuneConfig(epochs=epochs, prompt_len=prompt_len,
                           batch_size=batch_size)


_ALL_LEFT = (4, 8, 10, 12, 15, 25, 30)
_ALL_MEMORY = (2, 3, 5, 7)
_APPENDIX_D_TASK = tasks_lib.TaskConfig(num_train=5000, num_val=500,
                                        num_test=1000, seq_len=128)


def _tiny() -> Setup:
  """Seconds: for tests and smoke runs."""
  return Setup(trials=2, tasks_per_hmm=1, left_sizes=(4, 12),
               memory_sizes=(2,),
               task=tasks_lib.TaskConfig(num_train=128, num_val=32,
                                         num_test=64, seq_len=16),
               tune=_tune(2, 4, 32), pretrain=pretrain_lib.configure("tiny"))


def _cpu() -> Setup:
  """The main job: both panels with the transformer on 2 CPU cores, 3
  trials per size (an HMM draw, its pretrained transformer and a task
  each). Vanilla HMMs are shared by the panels (sizes 8, 12, 28), so 7
  stacks of 3 are pretrained (``cpu_capped``: at most 2000 steps each);
  inputs are 80 positions as in the authors' tuning scripts (20 prompt
  vectors, MASK, 59 tokens); the head reads the raw output probabilities
  (the paper's ``G``; ``log`` is the other feature kind)."""
  return Setup(trials=3, tasks_per_hmm=1, left_sizes=(4, 8, 12, 28),
               memory_sizes=(2, 3, 7), features=("raw",),
               task=tasks_lib.TaskConfig(num_train=2000, num_val=500,
                                         num_test=1000, seq_len=59),
               tune=_tune(5, 20, 32),
               pretrain=pretrain_lib.configure("cpu_capped"))


def _paper() -> Setup:
  """Figure 3's protocol: every size of both panels, 20 trials per size on
  the left and 5 on the right (a new HMM, pretrained model and task each),
  Appendix D's task sizes and pretraining (for accelerators; the exact
  backbone runs it on 2 CPU cores, docs/figure3.md); heads on the raw
  probabilities (the paper's ``G``)."""
  return Setup(trials=20, right_trials=5, tasks_per_hmm=1,
               left_sizes=_ALL_LEFT, memory_sizes=_ALL_MEMORY,
               features=("raw",),
               task=_APPENDIX_D_TASK, tune=_tune(5, 20, 32),
               pretrain=pretrain_lib.configure("paper"))


def _gpu() -> Setup:
  """Figure 3 on one accelerator (``experiments/accelerator.py``, in chunks
  of whole size stacks): :func:`_paper`'s protocol (every size, 20 trials
  left and 5 right, Appendix D's task sizes and transformer: width 768, 6
  layers, 12 heads, context 512) with a pretraining recipe meant to come
  near the Bayes CE in at most 2000 steps instead of Appendix D's 3 epochs
  at lr 1e-5: exact-conditional targets on fresh samples every step,
  MASK-only corruption, a size's trials one after another in one program,
  learning-rate cycles, stopping at the end of the first cycle within 0.04
  nats of the Bayes CE."""
  # lr and cycles are provisional until the accelerator recipe search; a
  # change moves the setup fingerprint, and experiments/accelerator.py then
  # refuses to mix the new lines with docs/results/figure3-gpu/'s.
  cycles = (250, 250, 500, 1000)
  pretrain = pretrain_lib.configure(
      "paper", dtype="auto",  # bf16 compute on accelerators
      corpus=dict(fresh=True, val_seqs=256, chunk_len=512, mask_rate=0.15,
                  corruption="mask"),
      targets="exact", batch_size=64, lr=3e-4, warmup_steps=100,
      cycles=cycles, steps=sum(cycles), target_gap=0.04,
      # Runtime: one trial at a time. A vmap of 20 would need ~600 GiB of
      # step temporaries by XLA:CPU's count (`accelerator.py --step_memory`;
      # one trial's activations at batch 64 x 512 are ~30 GiB there), more
      # than any one device; on a GPU, --step_memory gives its own figure
      # and a larger setting may fit (docs/figure3_gpu.md).
      trials_per_vmap=1, eval_every=250, ckpt_every=250, log_every=50,
      keep=1)  # runtime: 20 trials' params + Adam are ~10 GB a checkpoint
  return Setup(trials=20, right_trials=5, tasks_per_hmm=1,
               left_sizes=_ALL_LEFT, memory_sizes=_ALL_MEMORY,
               features=("raw",), task=_APPENDIX_D_TASK,
               tune=_tune(5, 20, 32), pretrain=pretrain)


PRESETS = {"tiny": _tiny, "cpu": _cpu, "paper": _paper, "gpu": _gpu}


def get_setup(preset: str = "cpu",
              overrides: Mapping[str, Any] | None = None, **fields) -> Setup:
  """The named preset with overrides, validated.

  ``fields`` are top-level fields (``trials=2``); ``overrides`` maps config
  paths to values or strings (``{"pretrain.lr": 3e-3, "task.seq_len":
  "12"}``), as ``--config.<path>`` flags do. Raises ``ValueError`` naming
  an unknown preset or key, or a bad value.
  """
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r}; known: "
                     f"{', '.join(PRESETS)}")
  return config_flags.apply(PRESETS[preset](),
                            {**fields, **dict(overrides or {})})
