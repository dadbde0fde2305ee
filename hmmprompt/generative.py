"""Any generative *model* of the experiments, a vanilla :class:`hmm.HMM` or a
single-cell :class:`memory.MemoryHMM`: everything above the HMM math goes
through these functions, so a new kind is added here once."""

import functools
import hashlib
import io
import os

from typing_extensions import TypeIs

import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import hmm as hmm_lib
from hmmprompt import memory as memory_lib
from hmmprompt import files as files_lib
from hmmprompt import validation

Model = hmm_lib.HMM | memory_lib.MemoryHMM
KINDS = ("vanilla", "memory")


def kind(model) -> str:
  """``"vanilla"`` or ``"memory"``; ``TypeError`` naming any other type."""
  if isinstance(model, memory_lib.MemoryHMM):
    return "memory"
  if isinstance(model, hmm_lib.HMM):
    return "vanilla"
  raise TypeError(f"expected an HMM or a MemoryHMM, got {type(model).__name__}")


def is_memory(model: Model) -> TypeIs[memory_lib.MemoryHMM]:
  """Whether ``model`` is a memory HMM (else vanilla; :func:`kind`)."""
  return kind(model) == "memory"


def as_hmm(model: Model) -> hmm_lib.HMM:
  """The vanilla HMM that generates the same text (``|M||H|`` states)."""
  return memory_lib.to_hmm(model) if is_memory(model) else model


def latent_size(model: Model) -> int:
  """``Z``: ``|H|`` for a vanilla HMM, ``|M|`` for a memory HMM."""
  return model.memory_size if is_memory(model) else model.num_states


def hidden_size(model: Model) -> int:
  """States of :func:`as_hmm`'s HMM: ``|H|``, or ``|M||H|`` for memory."""
  return model.num_states * (model.memory_size if is_memory(model) else 1)


def sample_tokens(key, model: Model, length: int) -> jax.Array:
  """``int32 [length]`` tokens from the initial distribution; traceable."""
  return hmm_lib.draw_sequence(key, as_hmm(model), length)[0]


def latent_posterior(model: Model, tokens_T: jax.Array) -> jax.Array:
  """``[Z]``: ``P[H_0 | x_{-0}]`` (vanilla) or ``P[M | x]`` (memory: every
  task masks ``tokens_T[0]``, so ``P[M | x_{-0}]``). Traceable; vmap it."""
  return (memory_lib.token_memory_posterior(model, tokens_T) if is_memory(model)
          else hmm_lib.token_smooth(model, tokens_T).masked_posterior[0])


def random_model(key, model_kind: str, num_states: int, vocab_size: int,
                 memory_size: int = 0) -> Model:
  """Appendix D's random model; ``num_states``: ``|H|`` (syntax states)."""
  if validation.one_of("model kind", model_kind, KINDS) == "memory":
    return memory_lib.random_memory_hmm(key, memory_size, num_states,
                                        vocab_size)
  return hmm_lib.random_hmm(key, num_states, vocab_size)


# Trials: models of one kind and size stacked on a leading ``[K]`` axis.
def num_trials(model: Model) -> int | None:
  """``K`` for stacked models, ``None`` for a single one."""
  kind(model)
  # The first field (HMM.initial, MemoryHMM.memory_prior) is [K?, N].
  lead = model[0].ndim - 1
  if lead == 0:
    return None
  if lead != 1:
    raise ValueError(f"expected one model or a [K] stack of models, got "
                     f"{lead} leading axes")
  return int(model[0].shape[0])


def stack(models) -> Model:
  """``[K]`` stacked models from a sequence of models of one kind and size;
  ``ValueError`` if empty, of mixed kinds or of different sizes (named)."""
  if not (models := list(models)):
    raise ValueError("stack needs at least one model (a trial count >= 1)")
  if len(kinds := {kind(m) for m in models}) > 1:
    raise ValueError(f"cannot stack models of different kinds: {sorted(kinds)}")
  shapes = [tuple(leaf.shape for leaf in m) for m in models]
  for i, sh in enumerate(shapes):
    if sh != shapes[0]:
      raise ValueError(f"cannot stack models of different sizes: trial 0 "
                       f"has field shapes {shapes[0]}, trial {i} {sh}")
  if any(num_trials(m) is not None for m in models):
    raise ValueError("stack takes single models, not stacks")
  return type(models[0])(*(jnp.stack(fields) for fields in zip(*models)))


def trial(models: Model, k: int) -> Model:
  """Trial ``k`` of stacked models (validated)."""
  n = num_trials(models)
  if n is None or not 0 <= k < n:
    raise ValueError(f"trial {k} out of range for "
                     f"{'a single model' if n is None else f'{n} trials'}")
  return type(models)(*(leaf[k] for leaf in models))


def random_models(key, num: int, model_kind: str, num_states: int,
                  vocab_size: int, memory_size: int = 0) -> Model:
  """``[K]`` stacked :func:`random_model` draws in one vmapped call, trial ``k``
  from ``fold_in(key, k)``; ``ValueError``: ``num < 1``, a bad kind or size."""
  if not isinstance(num, int) or num < 1:
    raise ValueError(f"the trial count must be an int >= 1, got {num!r}")
  # random_model's checks are Python: they raise while the vmap traces.
  drawn = _draw_stacked(key, num, model_kind, num_states, vocab_size,
                        memory_size)
  return type(drawn)(*drawn)  # validated, per trial


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _draw_stacked(key, num, model_kind, num_states, vocab_size, memory_size):
  # One compiled program (eager vmap would compile op by op).
  keys = jax.vmap(lambda k: jax.random.fold_in(key, k))(jnp.arange(num))
  return jax.vmap(lambda k: random_model(k, model_kind, num_states,
                                         vocab_size, memory_size))(keys)


def fingerprints(models: Model) -> list[str]:
  """:func:`model_fingerprint` of every trial of stacked models."""
  num = num_trials(models)
  if num is None:
    raise ValueError("fingerprints needs [K] stacked models; use "
                     "fingerprint for one model")
  host = [np.asarray(leaf, np.float32) for leaf in models]
  return [_fingerprint(kind(models), [a[k] for a in host]) for k in range(num)]


def model_fingerprint(model: Model) -> str:
  """12 hex digits of a hash of the kind and the float32 parameters."""
  return _fingerprint(kind(model), model)


def _fingerprint(model_kind: str, leaves) -> str:
  h = hashlib.sha256(model_kind.encode())
  for leaf in leaves:
    a = np.ascontiguousarray(leaf, np.float32)
    h.update(str(a.shape).encode() + a.tobytes())
  return h.hexdigest()[:12]


def save(path: str, model: Model) -> None:
  """Writes ``model`` to ``path`` (``.npz``) atomically."""
  buf = io.BytesIO()
  np.savez(buf, kind=np.array(kind(model)), **model._asdict())
  files_lib.atomic_write_bytes(path, buf.getvalue())


def load(path: str) -> Model:
  """Reads a model written by :func:`save` (validated): ``FileNotFoundError``
  if ``path`` does not exist, ``ValueError`` on a bad kind or parameters."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"no model file at {path}")
  with np.load(path) as z:
    model_kind = str(z["kind"])
    fields = {k: z[k] for k in z.files if k != "kind"}
  if model_kind not in KINDS:
    raise ValueError(f"{path} holds a model of unknown kind {model_kind!r}")
  return (memory_lib.MemoryHMM if model_kind == "memory"
          else hmm_lib.HMM)(**fields)


def same(a: Model, b: Model) -> bool:
  """Whether two models are of one kind with bitwise-equal parameters."""
  return kind(a) == kind(b) and all(
      np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
