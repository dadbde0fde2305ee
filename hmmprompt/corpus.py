"""Pretraining text from an HMM, and BERT masking (Appendix D).

Deterministic given a key and the step: a fixed corpus visited in epochs, or
``fresh`` sequences every step (small CPU presets; an unbounded corpus).
Selected positions (rate ``mask_rate``) become ``MASK`` (80%), a random symbol
(10%) or stay (10%), as BERT (``corruption="bert"``), or always ``MASK``
(``"mask"``, as evaluation). :func:`exact_targets` are the conditionals of the
true tokens: the sampled token's one-hot has them as its mean, so cross-entropy
to them has the same expected gradient with less variance."""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from hmmprompt import identity as identity_lib
from hmmprompt import hmm as hmm_lib
from hmmprompt import generative
from hmmprompt import validation


CORRUPTIONS = ("bert", "mask")
_BERT_MASK, _BERT_RANDOM = 0.8, 0.1


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
  """Pretraining text (defaults: the paper's corpus): ``num_seqs`` sampled
  sequences of ``seq_len`` tokens cut into ``chunk_len``-token examples."""

  num_seqs: int = 5000
  seq_len: int = 10240
  chunk_len: int = 512
  mask_rate: float = 0.05
  fresh: bool = False
  val_seqs: int = 64
  corruption: str = "bert"
  # Added after results were keyed (identity_lib.ADDED): the training
  # batches' masking rate (0: mask_rate); held-out sets keep mask_rate.
  train_mask_rate: float = identity_lib.added(0.0)

  def __post_init__(self):
    validation.require_choices(self, corruption=CORRUPTIONS)
    validation.require_positive(self, "num_seqs", "seq_len", "chunk_len",
                                "val_seqs")
    validation.require(self, "mask_rate", 0 < self.mask_rate < 1, "in (0, 1)")
    validation.require(self, "train_mask_rate", 0 <= self.train_mask_rate < 1,
                       "in [0, 1)")
    if not self.fresh and self.seq_len < self.chunk_len:
      raise ValueError(f"CorpusConfig.seq_len = {self.seq_len} is shorter "
                       f"than chunk_len = {self.chunk_len}")

  @property
  def num_chunks(self) -> int:
    return self.num_seqs * (self.seq_len // self.chunk_len)


@functools.partial(jax.jit, static_argnums=(2, 3))
def sample_sequences(key, model, num: int, length: int) -> jax.Array:
  """``[num, length]`` int32 sequences, each from the initial distribution."""
  return jax.vmap(lambda k: generative.sample_tokens(k, model, length))(
      jax.random.split(key, num))


def build_chunks(key, model, cfg: CorpusConfig) -> jax.Array:
  """The fixed corpus as ``[num_chunks, chunk_len]`` chunks."""
  per = cfg.seq_len // cfg.chunk_len
  tokens = sample_sequences(key, model, cfg.num_seqs, per * cfg.chunk_len)
  return tokens.reshape(cfg.num_chunks, cfg.chunk_len)


def mask_tokens(key, tokens_BxT, mask_rate: float, vocab_size: int,
                bert: bool = True):
  """``(inputs [B, T], weights [B, T])``; weights mark predicted positions."""
  k_sel, k_kind, k_rand = jax.random.split(key, 3)
  selected = jax.random.bernoulli(k_sel, mask_rate, tokens_BxT.shape)
  if bert:
    u = jax.random.uniform(k_kind, tokens_BxT.shape)
    random_tok = jax.random.randint(k_rand, tokens_BxT.shape, 0, vocab_size)
    replaced = jnp.where(u < _BERT_MASK, hmm_lib.MASK, jnp.where(
        u < _BERT_MASK + _BERT_RANDOM, random_tok, tokens_BxT))
  else:
    replaced = jnp.full_like(tokens_BxT, hmm_lib.MASK)
  inputs = jnp.where(selected, replaced, tokens_BxT)
  return inputs.astype(jnp.int32), selected.astype(jnp.float32)


def next_token_inputs(tokens_BxT):
  """A causal LM's inputs ``[MASK, x_0, .., x_{T-2}]``: position ``t``
  reads ``x_{<t}`` (``MASK`` the start of text) and predicts ``x_t``."""
  bos = jnp.full_like(tokens_BxT[..., :1], hmm_lib.MASK)
  return jnp.concatenate([bos, tokens_BxT[..., :-1]], -1)


def batch_at(key, step, model, chunks, cfg: CorpusConfig, batch_size: int,
             vocab_size: int, causal: bool = False):
  """The training batch of ``step``: ``(inputs, targets, weights)``, a pure
  function of ``(key, step)``; ``chunks`` is ``None`` in fresh mode. ``causal``:
  :func:`next_token_inputs`, every position weighted."""
  k_steps, k_epochs = jax.random.split(key)
  k_data, k_mask = jax.random.split(jax.random.fold_in(k_steps, step))
  if cfg.fresh:
    targets = sample_sequences(k_data, model, batch_size, cfg.chunk_len)
  else:
    n = chunks.shape[0]
    steps_per_epoch = n // batch_size
    epoch = step // steps_per_epoch
    perm = jax.random.permutation(jax.random.fold_in(k_epochs, epoch), n)
    start = (step % steps_per_epoch) * batch_size
    targets = chunks[jax.lax.dynamic_slice(perm, (start,), (batch_size,))]
  if causal:
    return (next_token_inputs(targets).astype(jnp.int32), targets,
            jnp.ones(targets.shape, jnp.float32))
  inputs, weights = mask_tokens(k_mask, targets,
                                cfg.train_mask_rate or cfg.mask_rate,
                                vocab_size, bert=cfg.corruption == "bert")
  return inputs, targets, weights


def corruption_likelihood(inputs_T, selected_T, vocab_size: int,
                          dtype=jnp.float32) -> jax.Array:
  """``[T, V]`` of ``dtype``: ``P(x~_t | X_t = x, S)`` up to a factor per
  position: one-hot if unselected, ones for ``MASK``, and for a selected
  symbol ``v`` (BERT's random or kept token) ``∝ 1/V + [x = v]``."""
  sym_T = jnp.where(inputs_T == hmm_lib.MASK, 0, inputs_T)
  onehot_TxV = jax.nn.one_hot(sym_T, vocab_size, dtype=dtype)
  noisy_TxV = (_BERT_RANDOM / vocab_size + (1 - _BERT_MASK - _BERT_RANDOM)
               * onehot_TxV) / (1 - _BERT_MASK)
  return jnp.where((inputs_T == hmm_lib.MASK)[:, None], 1.0,
                   jnp.where((selected_T > 0)[:, None], noisy_TxV, onehot_TxV))


def exact_state_posterior(hmm: hmm_lib.HMM, inputs_T, selected_T,
                          method: str = "sequential") -> jax.Array:
  """``[T, H]``: ``P[H_t | x~, S]`` (the auxiliary ``state_loss``'s target);
  ``method`` as :func:`exact_targets`'."""
  lik_TxV = corruption_likelihood(inputs_T, selected_T, hmm.vocab_size,
                                  hmm.emission.dtype)
  return hmm_lib.smooth_by(hmm, lik_TxV @ hmm.emission.T, method).posterior


def exact_targets(hmm: hmm_lib.HMM, inputs_T, selected_T,
                  method: str = "sequential") -> jax.Array:
  """``[T, V]``: ``P[X_t | x~, S]`` under :func:`mask_tokens`' corruption
  (either), all zero where ``x~`` is impossible; traceable. ``inputs_T``: the
  corrupted sequence; ``selected_T``: the selected positions (the loss weights);
  ``hmm``: the generating model as :func:`generative.as_hmm`; ``method``: a
  resolved kernel of :func:`hmm.smooth_by` (:func:`hmm.resolve_method`)."""
  lik_TxV = corruption_likelihood(inputs_T, selected_T, hmm.vocab_size,
                                  hmm.emission.dtype)
  evidence_TxH = lik_TxV @ hmm.emission.T
  prior_TxV = hmm_lib.evidence_conditionals(hmm, evidence_TxH, method)
  joint_TxV = prior_TxV * lik_TxV
  total_T = jnp.sum(joint_TxV, -1, keepdims=True)
  return joint_TxV / jnp.where(total_T > 0, total_T, 1.0)
