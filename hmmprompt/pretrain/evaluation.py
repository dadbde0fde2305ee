"""Held-out ``mlm_ce``, exact ``bayes_ce`` (:func:`hmm.conditionals`) and their
TV at ``MASK``ed positions (causal: at all, to ``P[X_t | x_<t]``)."""

import functools
import typing
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import corpus as corpus_lib
from hmmprompt import hmm as hmm_lib
from hmmprompt import generative
from hmmprompt.backbones import transformer
from hmmprompt.pretrain import batches
from hmmprompt.pretrain import train
from hmmprompt.pretrain import workdir as workdir_lib
from hmmprompt.pretrain.config import PretrainConfig


class ValidationSet(NamedTuple):
  """``inputs``/``targets``/``weights`` ``[N, T]``, ``exact [N, T, V]``."""

  inputs: jax.Array
  targets: jax.Array
  weights: jax.Array
  exact: jax.Array


@functools.partial(jax.jit, static_argnums=2)
def _exact_conditionals(hmm, inputs_NxT, method: str):
  return jax.vmap(functools.partial(hmm_lib.token_conditionals, method=method),
                  in_axes=(None, 0))(hmm, inputs_NxT)


# Module level: a jit made per call would compile once per trial.
_next_conditionals = jax.jit(jax.vmap(hmm_lib.token_next_conditionals,
                                      in_axes=(None, 0)))


def validation_set(key, model: generative.Model,
                   cfg: PretrainConfig) -> ValidationSet:
  """Held-out sequences of the context length, ``MASK``-only masking (a
  causal model: :func:`corpus.next_token_inputs`, every position)."""
  seqs = corpus_lib.sample_sequences(key, model, cfg.corpus.val_seqs,
                                     cfg.corpus.chunk_len)
  if cfg.model.causal:
    return ValidationSet(
        corpus_lib.next_token_inputs(seqs), seqs, jnp.ones(seqs.shape),
        _next_conditionals(generative.as_hmm(model), seqs))
  inputs, weights = corpus_lib.mask_tokens(
      jax.random.fold_in(key, 1), seqs, cfg.corpus.mask_rate,
      cfg.model.vocab_size, bert=False)
  return ValidationSet(inputs, seqs, weights, _exact_conditionals(
      generative.as_hmm(model), inputs,
      hmm_lib.resolve_method(cfg.exact_method, inputs.shape[-1])))


def gap_sums(p_model, targets, weights, exact) -> jax.Array:
  """``[4]``: weighted sums of the model's CE, the Bayes CE, their TV and
  the weight, from ``p_model [..., V]`` (traceable)."""
  ce = lambda p: -jnp.log(jnp.maximum(
      jnp.take_along_axis(p, targets[..., None], -1)[..., 0], 1e-30))
  sums = [ce(p_model), ce(exact), 0.5 * jnp.sum(jnp.abs(p_model - exact), -1)]
  return jnp.stack([jnp.sum(x * weights) for x in sums] + [jnp.sum(weights)])


@functools.partial(jax.jit, static_argnums=(1,))
def _eval_sums(params, model_cfg, inputs, targets, weights, exact):
  p_model = jax.nn.softmax(transformer.MLM(model_cfg).apply(params, inputs), -1)
  return gap_sums(p_model, targets, weights, exact)


def evaluate(params, cfg: PretrainConfig, val: ValidationSet) -> dict:
  """``{"mlm_ce", "bayes_ce", "tv", "ce_gap", "eval_positions"}``."""
  return evaluate_predictions(lambda sl: _eval_sums(
      params, cfg.model, *(x[sl] for x in val)), val, cfg.eval_batch)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _group_sums(params_N, model_cfg, trials_per_vmap: int, *val_NxB):
  return train.map_trials(lambda a: _eval_sums(a[0], model_cfg, *a[1:]),
                          (params_N, *val_NxB), trials_per_vmap)


def evaluate_group(params_N, cfg: PretrainConfig,
                   vals_N: ValidationSet) -> list[dict]:
  """:func:`evaluate` of ``N`` trials, ``params_N``/``vals_N`` ``[N, ...]``."""
  num, seqs = vals_N.inputs.shape[:2]
  tot = np.zeros((num, 4))
  for i in range(0, seqs, cfg.eval_batch):
    tot += np.asarray(_group_sums(params_N, cfg.model, cfg.trials_per_vmap, *(
        x[:, i:i + cfg.eval_batch] for x in vals_N)))
  return [_metrics(t) for t in tot]


def evaluate_predictions(sums_of, val: ValidationSet, batch: int) -> dict:
  """The metrics of ``sums_of(slice) -> [4]`` (:func:`gap_sums`) summed
  over slices of ``batch`` sequences."""
  tot = np.zeros(4)
  for i in range(0, val.inputs.shape[0], batch):
    tot += np.asarray(sums_of(slice(i, i + batch)))
  return _metrics(tot)


def _metrics(tot) -> dict:
  n = max(tot[3], 1.0)
  return {"mlm_ce": tot[0] / n, "bayes_ce": tot[1] / n, "tv": tot[2] / n,
          "ce_gap": (tot[0] - tot[1]) / n, "eval_positions": int(tot[3])}


def evaluate_checkpoints(cfg: PretrainConfig, models_K: generative.Model,
                         params_QxK) -> list[list[dict]]:
  """``metrics[q][k]`` of ``params_QxK[q, k]`` on its validation set: the
  loop's line at an evaluation step (to float rounding across groupings)."""
  num = typing.cast(int, generative.num_trials(models_K))  # stacked: an int
  keys = batches.Keys.of(cfg.seed, num)
  vals_K = jax.tree.map(lambda *xs: jnp.stack(xs), *[
      validation_set(keys.val[k], generative.trial(models_K, k), cfg)
      for k in range(num)])
  return [evaluate_group(workdir_lib.take(params_QxK, q), cfg, vals_K)
          for q in range(jax.tree.leaves(params_QxK)[0].shape[0])]
