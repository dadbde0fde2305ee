"""BERT-style masked LM in Flax (paper Section 5, Appendix D).

Token ids are the HMM's real symbols ``0..V-1`` plus ``[MASK]`` = ``V``
(``hmm.MASK`` (-1) in inputs is mapped to it), so the embedding table has
``V + 1`` rows and the output layer predicts only the ``V`` real symbols.
Pre-LayerNorm blocks (self-attention, GELU MLP), learned position
embeddings, a final LayerNorm. Params are fp32; ``MLMConfig.dtype`` sets the
compute dtype (bf16 on accelerators, fp32 on CPU); logits are fp32.

``embed`` and ``encode`` split the forward pass so soft prompts can be
prepended to the token embeddings (positions then count the prompt).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from hmmprompt import hmm as hmm_lib
from hmmprompt import validation
from hmmprompt.backbones import Backbone


POS_INITS = ("normal", "sinusoid")
"""How the learned position embeddings start: ``"normal"`` (BERT's N(0,
0.02^2)) or ``"sinusoid"`` (the Transformer's sin / cos table at the same
RMS, so that position ``t``'s dot product with ``t + k`` depends on ``k``
alone from the first step)."""


def sinusoid_init(key, shape, dtype=jnp.float32):
  """``[T, D]`` sin / cos position table (Vaswani et al.) scaled to RMS
  0.02; ``key`` unused (deterministic)."""
  del key
  t, d = shape
  freq_F = 1.0 / (10_000.0 ** (jnp.arange(0, d, 2) / d))
  angle_TxF = jnp.arange(t)[:, None] * freq_F[None, :]
  table = jnp.zeros(shape).at[:, 0::2].set(jnp.sin(angle_TxF))
  table = table.at[:, 1::2].set(jnp.cos(angle_TxF[:, :d // 2]))
  return (0.02 * jnp.sqrt(2.0) * table).astype(dtype)


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

  def __post_init__(self):
    validation.require_positive(self, "vocab_size", "d_model", "num_heads",
                                "d_ff", "num_layers", "max_len")
    if self.d_model % self.num_heads:
      raise ValueError(f"MLMConfig.d_model = {self.d_model} must be divisible "
                       f"by num_heads = {self.num_heads}")
    if self.pos_init not in POS_INITS:
      raise ValueError(f"MLMConfig.pos_init must be one of {POS_INITS}, got "
                       f"{self.pos_init!r}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"MLMConfig.dtype must be float32 or bfloat16, got "
                       f"{self.dtype!r}")

  @property
  def mask_id(self) -> int:
    return self.vocab_size

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)


def paper_config(vocab_size: int = 10, **kw) -> MLMConfig:
  """BERT-base width with 6 layers (Appendix D)."""
  return MLMConfig(vocab_size=vocab_size, d_model=768, num_heads=12,
                   d_ff=3072, num_layers=6, max_len=512, **kw)


class Block(nn.Module):
  cfg: MLMConfig

  @nn.compact
  def __call__(self, x_BxTxD):
    cfg = self.cfg
    dt = cfg.compute_dtype
    b, t, d = x_BxTxD.shape
    a, e = cfg.num_heads, cfg.d_model // cfg.num_heads
    y = nn.LayerNorm(dtype=dt, name="ln_attn")(x_BxTxD)
    # Heads-major [3, B, A, T, E] so both attention products are batched
    # matmuls over minor dims: XLA:CPU runs the [B, T, A, E] einsums of the
    # textbook layout several times slower (experiments/bench_mlm.py).
    qkv_3xBxAxTxE = nn.Dense(3 * d, dtype=dt, name="qkv")(y).reshape(
        b, t, 3, a, e).transpose(2, 0, 3, 1, 4)
    q, k, v = qkv_3xBxAxTxE[0], qkv_3xBxAxTxE[1], qkv_3xBxAxTxE[2]
    logits_BxAxTxT = jnp.matmul(q, jnp.swapaxes(k, -1, -2)) / jnp.sqrt(
        jnp.asarray(e, dt))
    attn = jax.nn.softmax(logits_BxAxTxT.astype(jnp.float32), -1).astype(dt)
    out_BxAxTxE = jnp.matmul(attn, v)
    x_BxTxD = x_BxTxD + nn.Dense(d, dtype=dt, name="attn_out")(
        out_BxAxTxE.transpose(0, 2, 1, 3).reshape(b, t, d))
    y = nn.LayerNorm(dtype=dt, name="ln_mlp")(x_BxTxD)
    y = nn.Dense(cfg.d_ff, dtype=dt, name="mlp_in")(y)
    y = nn.Dense(d, dtype=dt, name="mlp_out")(nn.gelu(y))
    return x_BxTxD + y


class MLM(nn.Module):
  """``__call__(tokens [B, T]) -> logits [B, T, V]`` (fp32)."""

  cfg: MLMConfig

  def setup(self):
    cfg = self.cfg
    init = nn.initializers.normal(0.02)
    self.tok_embed = nn.Embed(cfg.vocab_size + 1, cfg.d_model,
                              embedding_init=init, name="tok_embed")
    self.pos_embed = self.param(
        "pos_embed", sinusoid_init if cfg.pos_init == "sinusoid" else init,
        (cfg.max_len, cfg.d_model))
    self.blocks = [Block(cfg, name=f"block_{i}")
                   for i in range(cfg.num_layers)]
    self.ln_final = nn.LayerNorm(dtype=cfg.compute_dtype, name="ln_final")
    self.head = nn.Dense(cfg.vocab_size, dtype=cfg.compute_dtype,
                         name="head")

  def embed(self, tokens_BxT):
    ids = jnp.where(tokens_BxT == hmm_lib.MASK, self.cfg.mask_id, tokens_BxT)
    return self.tok_embed(ids)

  def encode(self, emb_BxTxD):
    t = emb_BxTxD.shape[-2]
    x = (emb_BxTxD + self.pos_embed[:t]).astype(self.cfg.compute_dtype)
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_final(x)).astype(jnp.float32)

  def __call__(self, tokens_BxT):
    return self.encode(self.embed(tokens_BxT))


def init_params(key, cfg: MLMConfig):
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


def make_backbone(cfg: MLMConfig) -> Backbone:
  """The backbone interface over ``MLM`` params (fp32 compute for tuning).

  Cached per config: a ``Backbone`` is a static jit argument of tuning, so
  two pretrained models of one config must give the *same* object (its
  functions are closures) to share compiled tuning programs
  (``experiments/bench_compiles.py`` measures what that saves).
  """
  return _cached_backbone(dataclasses.replace(cfg, dtype="float32"))


def build_backbone(cfg: MLMConfig) -> Backbone:
  """A new, uncached :func:`make_backbone` (new closures every call)."""
  cfg = dataclasses.replace(cfg, dtype="float32")
  model = MLM(cfg)

  def embed(params, tokens_T):
    _check_range(tokens_T, cfg)
    return model.apply(params, tokens_T[None], method=MLM.embed)[0]

  def apply(params, emb_TxD):
    if emb_TxD.shape[0] > cfg.max_len:
      raise ValueError(f"input of {emb_TxD.shape[0]} positions exceeds the "
                       f"model's context max_len = {cfg.max_len}")
    logits = model.apply(params, emb_TxD[None], method=MLM.encode)[0]
    return jax.nn.softmax(logits, -1)

  return Backbone(name="transformer", embed=embed, apply=apply,
                  prompt_embedding=lambda raw: raw, embed_dim=cfg.d_model,
                  vocab_size=cfg.vocab_size, finetunable=True)


_cached_backbone = functools.lru_cache(maxsize=None)(build_backbone)


def _check_range(tokens, cfg):
  if not isinstance(tokens, jax.core.Tracer):
    hmm_lib.check_tokens(tokens, cfg.vocab_size)
