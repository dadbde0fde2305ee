"""The sweep's config tree (:class:`Setup`), its named presets and its plan
(:func:`plan`: the groups it tunes, by model): every number that decides a
result line is a field of :class:`Setup`; :func:`get_setup` is the one way
in (each leaf a ``--config.<path>`` flag)."""

import dataclasses
from typing import Any
from collections.abc import Mapping

from hmmprompt import identity as identity_lib
from hmmprompt import protocol
from hmmprompt import config_flags
from hmmprompt import heads
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import sharding
from hmmprompt import tasks as tasks_lib
from hmmprompt import tuning
from hmmprompt.protocol import ModelId


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup(protocol.TrialsConfig):
  """Everything that decides a result line's value besides its key (the
  shared fields: :class:`protocol.TrialsConfig`; ``trials``: the left
  panel's draws per size, the paper's 20). A vanilla HMM of both panels is
  one stack of the larger count. ``arms`` (:func:`parse_arm`) replace head
  and prompt (and ``finetune``): left with the linear head, right with the
  attention head on memory HMMs alone; those meaningless on the exact
  backbone run on the transformer only (docs/adaptation.md)."""

  tasks_per_hmm: int  # > 1 separates task and HMM noise (reported)
  left_sizes: tuple[int, ...]  # |H| of the left panel's vanilla HMMs
  features: tuple[str, ...] = ("raw", "log")  # head features, an arm each
  finetune: bool = False  # full fine-tuning of the transformer, a third arm
  right_trials: int | None = None  # the right panel's (5; None: ``trials``)
  prompt_attention: bool = False  # Theorem 4.6: prompt + attention head
  head_optimum: bool = False  # each linear head's L-BFGS twin (``_lbfgs``)
  arms: tuple[str, ...] = ()  # the adaptation comparison's

  def __post_init__(self):
    for spec in self.arms:
      parse_arm(spec, self.tune)
    self._check(("trials", "tasks_per_hmm", "right_trials"),
                ("left_sizes", "memory_sizes"))
    if self.tune.optimizer != "adam":
      raise ValueError(f"Setup.tune.optimizer is set per arm by the sweep, got "
                       f"{self.tune.optimizer!r}: --config.head_optimum=true "
                       f"adds an L-BFGS twin of every head-tuning arm")
    bad = [f for f in self.features if f not in heads.FEATURES]
    if bad or not self.features:
      raise ValueError(f"Setup.features must be from {heads.FEATURES}, got "
                       f"{self.features}")

  def check_context(self) -> None:
    """``ValueError`` naming the arm whose input exceeds the context."""
    super().check_context()
    for spec in self.arms:
      method, settings = parse_arm(spec, self.tune)
      arm = dataclasses.replace(self.tune, method=method, **dict(settings))
      n = tasks_lib.input_len(arm.num_prompt, self.task.seq_len)
      if n > self.pretrain.model.max_len:
        raise ValueError(
            f"--config.arms {spec}: its prompt + 1 + seq_len = {n} positions "
            f"exceed the pretrained context of {self.pretrain.model.max_len}; "
            f"shorten its prompt or --config.task.seq_len")

  def fingerprint(self, backbone: str = "exact") -> str:
    """12 hex digits keying result lines to the setup that made them
    (:func:`fingerprint_of`); not which arms run (each line's method), nor
    ``tune``'s :data:`identity.ADDED` fields at their defaults."""
    return fingerprint_of(self.identity(), backbone)

  def identity(self) -> dict:
    """What ``DIR/sweep.json`` records: what decides its lines' values, and
    the trial counts (stack sizes); not sizes, panels, arms (add lines)."""
    return {"task": identity_lib.identity(self.task),
            "tune": identity_lib.identity(self.tune),
            "seed": self.seed, "model_keys": protocol.MODEL_KEYS_VERSION,
            "pretrain": self.pretrain.identity(), "trials": self.trials,
            "right_trials": self.panel_trials("right")}

  def panel_trials(self, panel: str) -> int:
    """HMM draws per size on ``panel`` (left | right)."""
    return (self.right_trials if panel == "right"
            and self.right_trials is not None else self.trials)


def fingerprint_of(identity: dict, backbone: str = "exact") -> str:
  """:meth:`Setup.fingerprint` from the setup's :meth:`Setup.identity`."""
  blob = {**identity, "tune": dict(identity["tune"])}
  del blob["trials"], blob["right_trials"]
  if backbone != "transformer":
    # Nothing pretrained, nothing computed in the backbone's dtype: the
    # exact backbone's lines key alike on every backend.
    del blob["pretrain"]
    blob["tune"].pop("backbone_dtype", None)
  return identity_lib.fingerprint(blob)


ARM_SETTINGS = {"head": (), "finetune": (), "lora": ("lora_r",),
                "prompt": ("prompt_len", "prompt_init_mode"),
                "prefix": ("prompt_len",)}
"""What an arm's spec sets after its method, ``-``-separated, in order."""


def parse_arm(spec: str, tune: tuning.TuneConfig) -> tuple[str, tuple]:
  """``(method, settings)`` of an arm: ``head``, ``prompt-LEN[-INIT]``
  (``INIT``: ``uniform`` | ``tokens``), ``prefix-LEN``, ``lora-RANK`` or
  ``finetune``, a prompt's setting equal to ``tune``'s left out (``tune``'s
  prompt is Figure 3's ``prompt`` line); ``ValueError`` naming a bad spec."""
  method, *values = spec.split("-")
  names = ARM_SETTINGS.get(method, ())
  if method not in ARM_SETTINGS or len(values) > len(names):
    raise ValueError(
        f"Setup.arms: {spec!r} is not an arm: head, prompt-LEN[-uniform|"
        f"tokens], prefix-LEN, lora-RANK or finetune")
  for n, v in zip(names, values):
    if type(getattr(tune, n)) is int and not v.isdigit():
      raise ValueError(f"Setup.arms: {spec!r}: {n} must be a whole number "
                       f"(the form: {method}-{ {'lora_r': 'RANK'}.get(n, 'LEN')})")
  try:
    settings = tuple((n, type(getattr(tune, n))(v))
                     for n, v in zip(names, values) if method != "prompt"
                     or type(getattr(tune, n))(v) != getattr(tune, n))
    dataclasses.replace(tune, method=method, **dict(settings))
  except ValueError as e:
    raise ValueError(f"Setup.arms: {spec!r}: {e}") from None
  return method, settings


@dataclasses.dataclass(frozen=True)
class Group(protocol.Group):
  """A tuning arm of one model size on one of Figure 3's panels."""

  panel: str = dataclasses.field(default="left", kw_only=True)  # | "right"

  def __str__(self) -> str:
    return f"{self.panel} {super().__str__()}"


def plan(setup: Setup, panel: str = "both",
         backbone: str = "exact") -> dict[ModelId, list[Group]]:
  """The groups (the arms of :class:`Setup`) of ``panel`` by model,
  models vanilla then memory by size (the order they run and shard in)."""
  out, syntax = [], protocol.MEMORY_SYNTAX_STATES
  arms = [parse_arm(a, setup.tune) for a in setup.arms]
  arms = [(m, s) for m, s in arms if backbone == "transformer"
          or not tuning.METHODS[m].needs_finetunable]
  if panel in ("left", "both"):
    methods = arms if setup.arms else [(m, ()) for m in ["head", "prompt"] + (
        ["finetune"] if setup.finetune and backbone == "transformer" else [])]
    out += [Group(ModelId("vanilla", h, 0), method, "linear", f, panel="left",
                  settings=settings) for h in setup.left_sizes
            for method, settings in methods for f in setup.features]
  if panel in ("right", "both") and setup.arms:
    out += [Group(ModelId("memory", syntax, m), method, "attention", f,
                  panel="right", settings=settings) for m in setup.memory_sizes
            for method, settings in arms for f in setup.features]
  elif panel in ("right", "both"):
    paper = [("memory", "head", "attention")] + (
        [("memory", "prompt", "attention")] if setup.prompt_attention else [])
    out += [Group(ModelId("memory", syntax, m) if hmm == "memory" else
                  ModelId("vanilla", syntax * m, 0),
                  method, head, f, panel="right") for m in setup.memory_sizes
            for hmm, method, head in paper + [("vanilla", "head", "linear")]
            for f in setup.features]
  if setup.head_optimum:
    out = [twin for g in out for twin in (
        (g, dataclasses.replace(g, optimizer="lbfgs"))
        if g.method == "head" and g.head == "linear" else (g,))]
  by_model: dict[ModelId, list[Group]] = {}
  for g in sorted(out, key=lambda g: (g.model_id.hmm != "vanilla",  # stable
                                      g.model_id.size)):
    by_model.setdefault(g.model_id, []).append(g)
  return by_model


def stack_sizes(setup: Setup) -> dict[ModelId, int]:
  """Trials drawn per model: the most any panel reads, whichever panels
  this run does, so a stack never changes size."""
  return {mid: max(setup.panel_trials(g.panel) for g in groups)
          for mid, groups in plan(setup).items()}


def check_run(setup: Setup, backbones, pretrain_only: bool = False) -> None:
  """Before any work: ``ValueError`` naming what is wrong with the run."""
  bad = [b for b in backbones if b not in protocol.BACKBONES]
  if bad or not backbones:
    raise ValueError(f"--backbone must be from {','.join(protocol.BACKBONES)}; "
                     f"got {backbones}")
  if pretrain_only and "transformer" not in backbones:
    raise ValueError("--pretrain_only needs --backbone=transformer")
  if setup.finetune and "transformer" not in backbones:
    raise ValueError("--config.finetune needs --backbone=transformer (the "
                     "exact backbone has no free parameters to fine-tune)")
  layered = [a for a in setup.arms if tuning.METHODS[
      parse_arm(a, setup.tune)[0]].needs_finetunable]
  if layered and "transformer" not in backbones:
    raise ValueError(f"--config.arms {','.join(layered)}: no meaning on the "
                     f"exact backbone (no transformer layers): add "
                     f"--backbone=transformer")
  if "transformer" in backbones:
    setup.check_context()
    sharding.check_batch(setup.pretrain.batch_size, sharding.data_mesh())


def _tune(epochs: int, prompt_len: int, batch_size: int) -> tuning.TuneConfig:
  return tuning.TuneConfig(epochs=epochs, prompt_len=prompt_len,
                           batch_size=batch_size)


_ALL_LEFT = (4, 8, 10, 12, 15, 25, 30)
_ALL_MEMORY = (2, 3, 5, 7)


def _tiny() -> Setup:
  """Seconds: for tests and smoke runs."""
  return Setup(trials=2, tasks_per_hmm=1, left_sizes=(4, 12), memory_sizes=(2,),
               task=tasks_lib.TaskConfig(num_train=128, num_val=32,
                                         num_test=64, seq_len=16),
               tune=_tune(2, 4, 32), pretrain=pretrain_lib.configure("tiny"))


def _cpu() -> Setup:
  """The main job: both panels on 2 CPU cores, 3 trials per size
  (``cpu_capped``, a draw above its gaps pretrained again with 4 layers);
  80-position inputs as in the authors' tuning scripts; heads on the raw
  probabilities (the paper's ``G``)."""
  return Setup(trials=3, tasks_per_hmm=1, left_sizes=(4, 8, 12, 28),
               memory_sizes=(2, 3, 7), features=("raw",), tune=_tune(5, 20, 32),
               task=tasks_lib.TaskConfig(num_train=2000, num_val=500,
                                         num_test=1000, seq_len=59),
               pretrain=pretrain_lib.configure("cpu_capped", fallback_layers=4,
                                               fallback_gap=0.06))


def _paper() -> Setup:
  """Figure 3's protocol: every size, 20 trials per size left and 5 right,
  Appendix D's task sizes and pretraining; heads on the raw probabilities."""
  return Setup(trials=20, right_trials=5, tasks_per_hmm=1, features=("raw",),
               left_sizes=_ALL_LEFT, memory_sizes=_ALL_MEMORY,
               tune=_tune(5, 20, 32), pretrain=pretrain_lib.configure("paper"),
               task=tasks_lib.TaskConfig(num_train=5000, num_val=500,
                                         num_test=1000, seq_len=128))


def _cpu_paper() -> Setup:
  """Figure 3's protocol on 2 CPU cores: :func:`_paper`'s trials and sizes
  with :func:`_cpu`'s model, pretraining and tasks (the paper's 128 tokens
  exceed its context), in chunks into ``docs/results/figure3-cpu-paper/``;
  the 4-layer fallback also comes early (docs/figure3.md)."""
  cpu = _cpu()
  return dataclasses.replace(
      cpu, trials=20, right_trials=5, left_sizes=_ALL_LEFT,
      memory_sizes=_ALL_MEMORY,
      pretrain=cpu.pretrain.with_overrides(fallback_gaps=(0.3, 0.12)))


def _gpu() -> Setup:
  """Figure 3 on one accelerator, in chunks (docs/figure3_gpu.md):
  :func:`_paper`'s protocol and transformer, pretrained with ``cpu_capped``'s
  recipe to the first cycle's end within the target; :func:`_cpu_paper`'s
  tasks (its exact backbone's lines are this protocol's too); the backbone
  tunes in the dtype it pretrained in (bf16 on an accelerator)."""
  cycles = (250, 250, 500, 1000)
  pretrain = pretrain_lib.configure(
      "paper", dtype="auto",  # bf16 compute on accelerators
      model=dict(rel_pos="bias"),
      corpus=dict(fresh=True, val_seqs=256, chunk_len=512, mask_rate=0.15,
                  corruption="mask", train_mask_rate=0.4),
      targets="exact", batch_size=64, optimizer="muon", lr=1e-2,
      warmup_steps=100, cycles=cycles, steps=sum(cycles), target_gap=0.04,
      trials_per_vmap=4, eval_every=250, ckpt_every=250, log_every=50,
      keep=1)  # runtime, fits an H100: 20 trials' params + Muon's are ~7 GB
  cpu = _cpu_paper()
  return dataclasses.replace(_paper(), pretrain=pretrain, task=cpu.task, tune=(
      dataclasses.replace(cpu.tune, backbone_dtype=pretrain.model.dtype)))


def _adaptation() -> Setup:
  """The adaptation comparison (docs/adaptation.md): :func:`_cpu_paper`'s
  draws, tasks and transformers, 5 draws of ``|H|`` = 8, 12, 20, 30 and of
  ``|M|`` = 3, each arm on both backbones where it has a meaning."""
  return dataclasses.replace(
      _cpu_paper(), trials=5, right_trials=5, left_sizes=(8, 12, 20, 30),
      memory_sizes=(3,), arms=(
          "head", "prompt-1", "prompt-5", "prompt-20", "prompt-1-tokens",
          "prompt-5-tokens", "prompt-20-tokens", "prefix-5", "lora-1",
          "lora-4", "finetune"))


PRESETS = {"tiny": _tiny, "cpu": _cpu, "cpu_paper": _cpu_paper,
           "paper": _paper, "gpu": _gpu, "adaptation": _adaptation}


def get_setup(preset: str = "cpu", overrides: Mapping[str, Any] | None = None,
              **fields) -> Setup:
  """The named preset with overrides (:func:`config_flags.from_preset`);
  ``ValueError`` for a bad preset or override, or one that empties a
  panel's sizes (``--panel`` chooses panels)."""
  for name, panel in (("left_sizes", "right"), ("memory_sizes", "left")):
    given = (overrides or {}).get(name, fields.get(name))
    if given is not None and not str(given).strip("(), "):
      raise ValueError(
          f"--config.{name} is empty: name at least one size (e.g. "
          f"{','.join(map(str, getattr(PRESETS['tiny'](), name)))}); "
          f"--panel={panel} runs the {panel} panel alone")
  return config_flags.from_preset(PRESETS, preset, overrides, **fields)
