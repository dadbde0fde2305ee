"""BERT-style masked LM in Flax (paper Section 5, Appendix D).

Token ids are the HMM's real symbols ``0..V-1`` plus ``[MASK]`` = ``V``
(``hmm.MASK`` (-1) in inputs is mapped to it), so the embedding table has
``V + 1`` rows and the output layer predicts only the ``V`` real symbols.
Pre-LayerNorm blocks (self-attention, GELU MLP), learned position
embeddings, a final LayerNorm. Params are fp32; ``MLMConfig.dtype`` sets the
compute dtype (bf16 on accelerators, fp32 on CPU); logits are fp32.
``MLMConfig.attention`` picks how attention is computed (by hand, the
default on CPU, or ``jax.nn.dot_product_attention``, the default elsewhere).

``embed`` and ``encode`` split the forward pass so soft prompts can be
prepended to the token embeddings (positions then count the prompt).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from hmmprompt import identity as identity_lib
from hmmprompt import hmm as hmm_lib
from hmmprompt import validation
from hmmprompt.backbones import Backbone
from hmmprompt.backbones.attention import dot_product_attention


POS_INITS = ("normal", "sinusoid")
"""How the learned position embeddings start: ``"normal"`` (BERT's N(0,
0.02^2)) or ``"sinusoid"`` (the Transformer's sin / cos table at the same
RMS, so that position ``t``'s dot product with ``t + k`` depends on ``k``
alone from the first step)."""


REL_POS = ("none", "bias", "alibi")
"""Relative-position terms added to every attention logit, beside the
absolute position table: ``"none"`` (BERT's), ``"bias"`` (a learned bias
per layer, head and offset ``j - i``, initialised at 0: attending at a
fixed offset is one parameter; Shaw et al. 2018, T5 without buckets) or
``"alibi"`` (a fixed ``-m_a |i - j|`` with ALiBi's slopes ``m_a =
2^(-8 (a + 1) / A)``, symmetric for a bidirectional model; Press et al.
2022). Either path of ``ATTENTIONS`` adds it (``"dot_product"`` passes
it to :func:`dot_product_attention` as a ``[1, A, T, T]`` bias)."""


ATTENTIONS = ("auto", "manual", "dot_product")
"""How ``Block`` computes attention: ``"manual"`` (softmax(Q K^T / sqrt(E))
V by hand in a heads-major layout, what XLA:CPU runs fastest),
``"dot_product"`` (``jax.nn.dot_product_attention``, through
:func:`dot_product_attention`: cuDNN's fused kernel where it applies) or
``"auto"`` (``"manual"`` on CPU, ``"dot_product"`` elsewhere, by
``jax.default_backend()`` when the model is traced)."""


# init_params is one jitted program, yet must give the op-by-op (eager)
# init's values, which committed results were drawn from. XLA would
# reassociate constant scalings (sqrt(2) * erfinv(u) * 0.02) and fold the
# sinusoid's constants; a barrier keeps each op's result as the eager op
# rounded it (tests/test_transformer.py holds them equal bit for bit).
_kept = jax.lax.optimization_barrier


def normal_init(stddev: float):
  """``nn.initializers.normal(stddev)``'s values, jit or not."""
  def init(key, shape, dtype=jnp.float32):
    return _kept(jax.random.normal(key, shape, dtype)) * jnp.array(
        stddev, dtype)
  return init


def sinusoid_init(key, shape, dtype=jnp.float32):
  """``[T, D]`` sin / cos positions (Vaswani et al.) at RMS 0.02; no key."""
  del key
  t, d = shape
  freq_F = _kept(1.0 / _kept(10_000.0 ** _kept(jnp.arange(0, d, 2) / d)))
  angle_TxF = _kept(jnp.arange(t)[:, None] * freq_F[None, :])
  table = _kept(jnp.zeros(shape).at[:, 0::2].set(_kept(jnp.sin(angle_TxF))))
  table = _kept(table.at[:, 1::2].set(_kept(jnp.cos(angle_TxF[:, :d // 2]))))
  return (_kept(0.02 * jnp.sqrt(2.0)) * table).astype(dtype)


@dataclasses.dataclass(frozen=True)
class MLMConfig:
  vocab_size: int = 10
  d_model: int = 768
  num_heads: int = 12
  d_ff: int = 3072
  num_layers: int = 6
  max_len: int = 512
  dtype: str = "float32"
  pos_init: str = "normal"
  # Added after results were keyed (identity_lib.ADDED: out of the
  # identity at their defaults). rel_pos: REL_POS. state_readout: the
  # number of hidden states of a linear readout from the final LayerNorm
  # (``MLM.logits_and_states``), trained only by PretrainConfig.state_loss
  # (0: none; tuning never reads it).
  rel_pos: str = dataclasses.field(default="none",
                                   metadata=identity_lib.ADDED)
  state_readout: int = dataclasses.field(default=0,
                                         metadata=identity_lib.ADDED)
  # How attention is computed (ATTENTIONS): a runtime choice, left out of
  # PretrainConfig.identity() (directory names, fingerprints, resume
  # checks), as the paths agree to float rounding.
  attention: str = dataclasses.field(default="auto",
                                     metadata=identity_lib.RUNTIME)

  def __post_init__(self):
    validation.require_positive(self, "vocab_size", "d_model", "num_heads",
                                "d_ff", "num_layers", "max_len")
    if self.d_model % self.num_heads:
      raise ValueError(f"MLMConfig.d_model = {self.d_model} must be divisible "
                       f"by num_heads = {self.num_heads}")
    if self.pos_init not in POS_INITS:
      raise ValueError(f"MLMConfig.pos_init must be one of {POS_INITS}, got "
                       f"{self.pos_init!r}")
    if self.rel_pos not in REL_POS:
      raise ValueError(f"MLMConfig.rel_pos must be one of {REL_POS}, got "
                       f"{self.rel_pos!r}")
    if not (isinstance(self.state_readout, int) and self.state_readout >= 0):
      raise ValueError(f"MLMConfig.state_readout must be an int >= 0, got "
                       f"{self.state_readout!r}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"MLMConfig.dtype must be float32 or bfloat16, got "
                       f"{self.dtype!r}")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"MLMConfig.attention must be one of {ATTENTIONS}, "
                       f"got {self.attention!r}")

  @property
  def mask_id(self) -> int:
    return self.vocab_size

  @property
  def resolved_attention(self) -> str:
    """``"manual"`` or ``"dot_product"`` (``"auto"`` resolved by the
    default backend: call at trace time)."""
    if self.attention == "auto":
      return "manual" if jax.default_backend() == "cpu" else "dot_product"
    return self.attention

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)


class TokenDense(nn.Dense):
  """``nn.Dense`` over the last axis, applied to the input flattened to
  ``[N, D]``: the same parameters and values, but XLA:CPU computes the
  weight gradient of a ``[B, T, D]`` Dense ~2.6x slower than that of the
  flattened one (a full 2-layer train step 13% slower;
  docs/performance.md)."""

  @nn.compact
  def __call__(self, x):
    y = super().__call__(x.reshape(-1, x.shape[-1]))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def paper_config(vocab_size: int = 10, **kw) -> MLMConfig:
  """BERT-base width with 6 layers (Appendix D)."""
  return MLMConfig(vocab_size=vocab_size, d_model=768, num_heads=12,
                   d_ff=3072, num_layers=6, max_len=512, **kw)


class Block(nn.Module):
  cfg: MLMConfig

  @nn.compact
  def __call__(self, x_BxTxD, query: int | None = None):
    """``[B, T, D]``, or with ``query`` (static) ``[B, 1, D]``: that
    position's output alone (its attention still reads every position)."""
    cfg = self.cfg
    dt = cfg.compute_dtype
    b, t, d = x_BxTxD.shape
    a, e = cfg.num_heads, cfg.d_model // cfg.num_heads
    y = nn.LayerNorm(dtype=dt, name="ln_attn")(x_BxTxD)
    if cfg.resolved_attention == "dot_product":
      # [B, T, A, E], dot_product_attention's layout (vmaps fold into B,
      # or into A where the relative-position bias is vmapped).
      qkv_BxTx3xAxE = TokenDense(3 * d, dtype=dt, name="qkv")(y).reshape(
          b, t, 3, a, e)
      bias_1xAxTxT = (None if cfg.rel_pos == "none"
                      else rel_bias(cfg, t, self._rel_table())[None])
      out_BxTxAxE = dot_product_attention(qkv_BxTx3xAxE[:, :, 0],
                                          qkv_BxTx3xAxE[:, :, 1],
                                          qkv_BxTx3xAxE[:, :, 2],
                                          bias_1xAxTxT)
      x_BxTxD = x_BxTxD + TokenDense(d, dtype=dt, name="attn_out")(
          out_BxTxAxE.reshape(b, t, d))
      if query is not None:
        x_BxTxD = x_BxTxD[:, query:query + 1]
    else:
      # Heads-major [3, B, A, T, E] so both attention products are batched
      # matmuls over minor dims: XLA:CPU runs the [B, T, A, E] einsums of
      # the textbook layout several times slower (experiments/bench_mlm.py).
      qkv_3xBxAxTxE = TokenDense(3 * d, dtype=dt, name="qkv")(y).reshape(
          b, t, 3, a, e).transpose(2, 0, 3, 1, 4)
      q, k, v = qkv_3xBxAxTxE[0], qkv_3xBxAxTxE[1], qkv_3xBxAxTxE[2]
      rows = slice(None) if query is None else slice(query, query + 1)
      q = q[:, :, rows]  # [B, A, Q, E], Q = T or 1
      logits_BxAxQxT = jnp.matmul(q, jnp.swapaxes(k, -1, -2)) / jnp.sqrt(
          jnp.asarray(e, dt))
      if cfg.rel_pos != "none":
        logits_BxAxQxT = logits_BxAxQxT + rel_bias(
            cfg, t, self._rel_table())[:, rows].astype(dt)
      attn = jax.nn.softmax(logits_BxAxQxT.astype(jnp.float32),
                            -1).astype(dt)
      out_BxAxQxE = jnp.matmul(attn, v)
      x_BxTxD = x_BxTxD[:, rows] + TokenDense(d, dtype=dt, name="attn_out")(
          out_BxAxQxE.transpose(0, 2, 1, 3).reshape(b, q.shape[2], d))
    y = nn.LayerNorm(dtype=dt, name="ln_mlp")(x_BxTxD)
    y = TokenDense(cfg.d_ff, dtype=dt, name="mlp_in")(y)
    y = TokenDense(d, dtype=dt, name="mlp_out")(nn.gelu(y))
    return x_BxTxD + y

  def _rel_table(self):
    """The learned ``[A, 2 max_len - 1]`` offset table (``"bias"``; the
    param ``rel_bias``), or None (``"alibi"``)."""
    cfg = self.cfg
    if cfg.rel_pos != "bias":
      return None
    return self.param("rel_bias", nn.initializers.zeros,
                      (cfg.num_heads, 2 * cfg.max_len - 1))


def rel_bias(cfg: MLMConfig, t: int, table_AxO=None):
  """``[A, T, T]``: the relative-position term of the attention logits
  (``table_AxO``: the learned ``"bias"``, offsets ``-(L-1)..L-1``)."""
  offset_TxT = jnp.arange(t)[None, :] - jnp.arange(t)[:, None]
  if cfg.rel_pos == "alibi":
    slope_A = 2.0 ** (-8.0 * (jnp.arange(cfg.num_heads) + 1)
                      / cfg.num_heads)
    return -slope_A[:, None, None] * jnp.abs(offset_TxT)[None]
  # The Toeplitz matrix M[i, j] = w[j - i + t - 1] by tiling and reshaping
  # (no gather: its gradient, a scatter-add, was the slow part on CPU).
  if t == 1:
    return table_AxO[:, cfg.max_len - 1:cfg.max_len][:, None]
  w_AxW = table_AxO[:, cfg.max_len - t:cfg.max_len + t - 1]  # W = 2t - 1
  w_AxW = jnp.roll(w_AxW, -(t - 1), axis=-1)  # w'[k] = w[k + t - 1 mod W]
  flat = jnp.tile(w_AxW, (1, t))[:, :t * (2 * t - 2)]
  return flat.reshape(-1, t, 2 * t - 2)[:, :, :t]


class MLM(nn.Module):
  """``__call__(tokens [B, T]) -> logits [B, T, V]`` (fp32)."""

  cfg: MLMConfig

  def setup(self):
    cfg = self.cfg
    init = normal_init(0.02)
    self.tok_embed = nn.Embed(cfg.vocab_size + 1, cfg.d_model,
                              embedding_init=init, name="tok_embed")
    self.pos_embed = self.param(
        "pos_embed", sinusoid_init if cfg.pos_init == "sinusoid" else init,
        (cfg.max_len, cfg.d_model))
    self.blocks = [Block(cfg, name=f"block_{i}")
                   for i in range(cfg.num_layers)]
    self.ln_final = nn.LayerNorm(dtype=cfg.compute_dtype, name="ln_final")
    self.head = TokenDense(cfg.vocab_size, dtype=cfg.compute_dtype,
                         name="head")
    if cfg.state_readout:
      self.state_head = TokenDense(cfg.state_readout, dtype=cfg.compute_dtype,
                                 name="state_head")

  def embed(self, tokens_BxT):
    ids = jnp.where(tokens_BxT == hmm_lib.MASK, self.cfg.mask_id, tokens_BxT)
    return self.tok_embed(ids)

  def encode(self, emb_BxTxD):
    return self.head(self.features(emb_BxTxD)).astype(jnp.float32)

  def encode_at(self, emb_BxTxD, query: int):
    """``encode(emb)[:, query]`` as ``[B, V]``: the last block computes that
    position alone."""
    return self.head(self.features(emb_BxTxD, query)[:, 0]).astype(
        jnp.float32)

  def features(self, emb_BxTxD, query: int | None = None):
    t = emb_BxTxD.shape[-2]
    x = (emb_BxTxD + self.pos_embed[:t]).astype(self.cfg.compute_dtype)
    for i, block in enumerate(self.blocks):
      x = block(x, query if i == len(self.blocks) - 1 else None)
    return self.ln_final(x)

  def logits_and_states(self, tokens_BxT):
    """``(logits [B, T, V], state logits [B, T, state_readout])``, fp32."""
    h = self.features(self.embed(tokens_BxT))
    return (self.head(h).astype(jnp.float32),
            self.state_head(h).astype(jnp.float32))

  def __call__(self, tokens_BxT):
    if self.is_initializing() and self.cfg.state_readout:
      return self.logits_and_states(tokens_BxT)[0]
    return self.encode(self.embed(tokens_BxT))


@functools.partial(jax.jit, static_argnums=1)
def init_params(key, cfg: MLMConfig):
  """An ``MLM``'s params from ``key`` (one program, not one per op)."""
  return MLM(cfg).init(key, jnp.zeros((1, min(cfg.max_len, 8)), jnp.int32))


def num_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


def train_flops_per_token(cfg: MLMConfig, seq_len: int) -> float:
  """Model FLOPs of one training step per token, for MFU.

  Forward + backward = 3 x forward: 6 x the matmul params (attention
  projections, MLP, output layer) plus 12 x layers x T x d for the
  attention score and value products; embeddings, norms and softmaxes are
  not counted (the usual convention; XLA's own count is within ~5%).
  """
  d = cfg.d_model
  matmul_params = (cfg.num_layers * (4 * d * d + 2 * d * cfg.d_ff)
                   + d * cfg.vocab_size)
  return float(6 * matmul_params + 12 * cfg.num_layers * seq_len * d)


def make_backbone(cfg: MLMConfig, dtype: str = "float32") -> Backbone:
  """The backbone interface over ``MLM`` params, computing in ``dtype``
  (``TuneConfig.backbone_dtype``; float32 by default, whatever ``cfg``
  was pretrained in).

  Cached per config: a ``Backbone`` is a static jit argument of tuning, so
  two pretrained models of one config must give the *same* object (its
  functions are closures) to share compiled tuning programs
  (``experiments/bench_compiles.py`` measures what that saves).
  """
  return _cached_backbone(dataclasses.replace(cfg, dtype=dtype))


def build_backbone(cfg: MLMConfig, dtype: str = "float32") -> Backbone:
  """A new, uncached :func:`make_backbone` (new closures every call)."""
  cfg = dataclasses.replace(cfg, dtype=dtype)
  model = MLM(cfg)

  def embed(params, tokens_T):
    _check_range(tokens_T, cfg)
    return model.apply(params, tokens_T[None], method=MLM.embed)[0]

  def _check_context(emb_TxD):
    if emb_TxD.shape[0] > cfg.max_len:
      raise ValueError(f"input of {emb_TxD.shape[0]} positions exceeds the "
                       f"model's context max_len = {cfg.max_len}")

  def apply(params, emb_TxD):
    _check_context(emb_TxD)
    logits = model.apply(params, emb_TxD[None], method=MLM.encode)[0]
    return jax.nn.softmax(logits, -1)

  def apply_at(params, emb_TxD, index):
    _check_context(emb_TxD)
    logits = model.apply(params, emb_TxD[None], index, method=MLM.encode_at)
    return jax.nn.softmax(logits[0], -1)

  return Backbone(name="transformer", embed=embed, apply=apply,
                  apply_at=apply_at,
                  prompt_embedding=lambda raw: raw, embed_dim=cfg.d_model,
                  vocab_size=cfg.vocab_size, finetunable=True)


_cached_backbone = functools.lru_cache(maxsize=None)(build_backbone)


def _check_range(tokens, cfg):
  if not isinstance(tokens, jax.core.Tracer):
    hmm_lib.check_tokens(tokens, cfg.vocab_size)
