"""Downstream classification tasks (paper Section 5, Appendix D).

An example is ``MASK`` at position 0 and ``seq_len`` tokens; its label is
``argmax_c (mu @ p)_c`` (``mu [C, Z]``: :func:`task_weights`) with ``p`` the
exact posterior of the task's latent: ``P[H_0 | x_{1:T}]``, the state at the
``MASK`` (vanilla, ``Z = |H|``), or ``P[M | x_{1:T}]`` (memory, ``Z = |M|``).
``labeling="authors"`` reproduces the original code instead: the real tokens
start from ``HMM.initial`` (the ``MASK`` is prepended, not sampled) and the
vanilla latent is ``transition @ P[H_1 | x_{1:T}]`` (memory tasks are labelled
alike in both modes). A dataset whose majority label (over all splits) exceeds
``max_label_share`` is re-drawn (:func:`make_tasks`), as the original did."""

import dataclasses
import functools
from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import hmm as hmm_lib
from hmmprompt import corpus
from hmmprompt import generative
from hmmprompt import validation

Model = generative.Model


LABELINGS = ("paper", "authors")
"""How a label reads the posterior (module doc)."""

TASK_BUDGET_BYTES = 512 << 20
"""Bytes a :func:`make_tasks` draw's smoothing may hold at once (~5 float32
``[T, S]`` arrays an example; docs/performance.md, "Bounded memory")."""


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """Sizes and options of a downstream task (defaults: Appendix D)."""

  num_train: int = 5000
  num_val: int = 500
  num_test: int = 1000
  seq_len: int = 128
  num_classes: int = 2
  num_nonzero: int = 6
  max_label_share: float = 0.9
  max_redraws: int = 100
  labeling: str = "paper"

  def __post_init__(self):
    validation.require_positive(self, "num_train", "num_val", "num_test",
                                "seq_len", "num_nonzero")
    validation.require(self, "num_classes", not self.num_classes < 2, ">= 2")
    validation.require(self, "max_label_share",
                       0.5 <= self.max_label_share <= 1.0, "in [0.5, 1]")
    if self.max_redraws < 0:
      raise ValueError("TaskConfig.max_redraws must be >= 0")
    check_labeling(self.labeling, "TaskConfig.labeling")


def mask_index(num_prompt: int) -> int:
  """Index of the ``MASK`` in a backbone input ``(prompt, MASK, x_1..x_T)``."""
  return num_prompt


def input_len(num_prompt: int, seq_len: int) -> int:
  """Positions of a backbone input: ``num_prompt`` + ``MASK`` + ``seq_len``."""
  return num_prompt + 1 + seq_len


class Split(NamedTuple):
  """One split. ``tokens [N, T+1]`` int32 (``MASK`` at 0), ``labels [N]``,
  ``latent [N, Z]`` the posterior the labels were computed from."""

  tokens: jax.Array
  labels: jax.Array
  latent: jax.Array


class Task(NamedTuple):
  mu: jax.Array  # [C, Z]
  train: Split
  val: Split
  test: Split
  redraws: int


def check_labeling(labeling: str, name: str = "labeling") -> str:
  """``labeling``; ``ValueError`` unless ``"paper"`` or ``"authors"``."""
  if labeling not in LABELINGS:
    raise ValueError(f"{name} must be 'paper' or 'authors', got {labeling!r}")
  return labeling


def task_weights(key, num_latent: int, num_classes: int = 2,
                 num_nonzero: int = 6) -> jax.Array:
  """``mu [C, Z]``: ``num_nonzero`` N(0, 1) entries at random, the rest 0."""
  size = num_classes * num_latent
  k = min(num_nonzero, size)
  k_pos, k_val = jax.random.split(key)
  pos = jax.random.choice(k_pos, size, (k,), replace=False)
  flat = jnp.zeros((size,)).at[pos].set(jax.random.normal(k_val, (k,)))
  return flat.reshape(num_classes, num_latent)


def label_posterior(model: Model, tokens_T: jax.Array,
                    labeling: str = "paper") -> jax.Array:
  """``[Z]``: the posterior a label is a linear function of (module doc);
  ``tokens_T`` includes the leading ``MASK``. Traceable; vmap it."""
  if (check_labeling(labeling) == "authors"
      and not generative.is_memory(model)):
    first_real_H = hmm_lib.token_smooth(model, tokens_T[1:]).posterior[0]
    return model.transition @ first_real_H
  return generative.latent_posterior(model, tokens_T)


def labels_from_latent(mu: jax.Array, latent_NxZ: jax.Array) -> jax.Array:
  """``argmax_c (mu @ p)_c`` per row (ties go to the lower class)."""
  return jnp.argmax(latent_NxZ @ mu.T, axis=-1).astype(jnp.int32)


def sample_examples(key, model: Model, n: int, seq_len: int,
                    labeling: str = "paper") -> jax.Array:
  """``int32 [N, T+1]``: ``seq_len + 1`` sampled tokens, the first masked
  (``"paper"``), or ``MASK`` before ``seq_len`` ones (``"authors"``)."""
  check_labeling(labeling)
  length = seq_len if labeling == "authors" else seq_len + 1
  tokens_NxL = corpus.sample_sequences(key, model, n, length)
  if labeling == "authors":
    return jnp.pad(tokens_NxL, ((0, 0), (1, 0)), constant_values=hmm_lib.MASK)
  return tokens_NxL.at[:, 0].set(hmm_lib.MASK)


@functools.partial(jax.jit, static_argnums=(2, 3))
def draw_task(key, model: Model, config: TaskConfig, chunk: int | None = None):
  """One draw of ``(mu, (train, val, test))``, unchecked for degeneracy
  (:func:`make_tasks`). ``chunk``: latent posteriors of this many examples
  at a time (``lax.map``; ``None``: all): less memory, the same labels."""
  k_mu, k_tr, k_va, k_te = jax.random.split(key, 4)
  mu = task_weights(k_mu, generative.latent_size(model), config.num_classes,
                    config.num_nonzero)
  one = lambda t: label_posterior(model, t, config.labeling)
  splits = []
  for k, n in ((k_tr, config.num_train), (k_va, config.num_val),
               (k_te, config.num_test)):
    tokens = sample_examples(k, model, n, config.seq_len, config.labeling)
    latent = (jax.vmap(one)(tokens) if chunk is None or chunk >= n
              else jax.lax.map(one, tokens, batch_size=chunk))
    splits.append(Split(tokens, labels_from_latent(mu, latent), latent))
  return mu, tuple(splits)


def majority_share(labels, num_classes: int = 2) -> float:
  """The share of the most frequent label among ``labels`` (ints in ``[0,
  num_classes)``, any shape; 0.0 for none)."""
  counts = np.bincount(np.asarray(labels).ravel(), minlength=num_classes)
  return float(counts.max() / max(counts.sum(), 1))


def make_task(key, model: Model, config: TaskConfig = TaskConfig()) -> Task:
  """:func:`make_tasks` on ``key`` and ``model`` alone; ``ValueError`` if
  every one of ``1 + config.max_redraws`` draws is degenerate."""
  # generative.stack names a non-model (TypeError) or a stack (ValueError).
  return make_tasks(jnp.asarray(key)[None], generative.stack([model]), config)[0]


@functools.cache
def _draw_tasks(config: TaskConfig, stacked: bool, chunk: int | None):
  """``(keys [K], attempt, models [K]) -> draws [K]``, jitted once; not
  ``stacked`` (K = 1), no vmap: vmap's batched matmuls round differently."""
  def draw(key, attempt, model):
    return draw_task(jax.random.fold_in(key, attempt), model, config, chunk)
  if stacked:
    return jax.jit(jax.vmap(draw, in_axes=(0, None, 0)))
  first = lambda tree: jax.tree.map(lambda x: x[0], tree)
  return jax.jit(lambda keys_K, attempt, models_K: jax.tree.map(
      lambda x: x[None], draw(keys_K[0], attempt, first(models_K))))


def latent_chunk(models_K: Model, config: TaskConfig,
                 budget_bytes: int | None = TASK_BUDGET_BYTES) -> int | None:
  """Examples per trial whose latent posteriors :func:`make_tasks` computes at
  once (>= 1) as fit ``budget_bytes`` for all K trials; ``None`` if no budget."""
  if budget_bytes is None:
    return None
  per_example = 5 * 4 * (config.seq_len + 1) * generative.hidden_size(models_K)
  trials = generative.num_trials(models_K) or 1
  return max(1, budget_bytes // (per_example * trials))


def make_tasks(keys_K, models_K: Model, config: TaskConfig = TaskConfig(),
               budget_bytes: int | None = TASK_BUDGET_BYTES) -> list[Task]:
  """One task per trial of stacked models, trial ``k``'s from
  ``fold_in(keys_K[k], attempt)`` at its first attempt with balanced
  labels; each attempt is one vmapped call for all trials, in chunks
  (:func:`latent_chunk`). ``ValueError``: not stacked models, a key count
  other than the trial count, or a trial whose every draw was degenerate."""
  chunk = latent_chunk(models_K, config, budget_bytes)
  num = generative.num_trials(models_K)
  if num is None:
    raise ValueError("make_tasks needs [K] stacked models; use make_task "
                     "for one")
  keys_K = jnp.asarray(keys_K)
  if keys_K.shape[0] != num:
    raise ValueError(f"{keys_K.shape[0]} keys for {num} trials")
  draw = _draw_tasks(config, num > 1, chunk)
  out: list[Task | None] = [None] * num
  share: list[float | None] = [None] * num
  for attempt in range(config.max_redraws + 1):
    if all(t is not None for t in out):
      break
    # On the host: indexing device arrays per trial compiles a gather each.
    mu_K, splits_K = jax.device_get(draw(keys_K, attempt, models_K))
    for k in (k for k in range(num) if out[k] is None):
      mu, (train, val, test) = jax.tree.map(lambda x: x[k], (mu_K, splits_K))
      share[k] = share_k = majority_share(np.concatenate(
          [s.labels for s in (train, val, test)]), config.num_classes)
      if share_k <= config.max_label_share:
        out[k] = Task(mu, train, val, test, attempt)
  if bad := [k for k in range(num) if out[k] is None]:
    where = f"trial {bad[0]}: " if num > 1 else ""
    raise ValueError(
        f"{where}every one of {config.max_redraws + 1} drawn tasks was "
        f"degenerate (the last had a majority-label share of "
        f"{share[bad[0]]:.3f} > max_label_share = {config.max_label_share}); "
        f"raise max_label_share or max_redraws")
  return cast(list[Task], out)  # none is None now
