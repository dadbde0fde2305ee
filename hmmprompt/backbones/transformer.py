"""BERT-style masked LM in Flax (paper Section 5, Appendix D): pre-LayerNorm
blocks, learned positions, a final LayerNorm; fp32 params and logits. Token
ids are the HMM's symbols ``0..V-1`` plus ``[MASK]`` = ``V`` (``hmm.MASK``
maps to it). ``embed`` and ``encode`` split the forward pass so soft prompts
can be prepended (positions then count the prompt)."""

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
"""How position embeddings start: ``"normal"`` (BERT's N(0, 0.02^2)) or
``"sinusoid"`` (same RMS: ``t``'s dot product with ``t + k`` reads ``k``)."""

REL_POS = ("none", "bias", "alibi")
"""Relative-position terms of the attention logits: ``"none"``, ``"bias"``
(learned per layer, head and offset ``j - i``, from 0; T5 without buckets)
or ``"alibi"`` (a fixed ``-m_a |i - j|``, ``m_a = 2^(-8 (a + 1) / A)``)."""

ATTENTIONS = ("auto", "manual", "dot_product")
"""How ``Block`` computes attention: ``"manual"`` (fastest on XLA:CPU),
``"dot_product"`` (:func:`dot_product_attention`, cuDNN where it applies) or
``"auto"`` (``"manual"`` on CPU, else ``"dot_product"``, at trace time)."""


# init_params is jitted, yet must give the eager init's values (committed
# results were drawn from them): a barrier keeps XLA from reassociating or
# folding constants (tests/test_transformer.py checks them bit for bit).
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
  # ADDED: out of identities at their defaults. state_readout: states of a
  # readout (MLM.logits_and_states; 0: none) for PretrainConfig.state_loss.
  rel_pos: str = identity_lib.added("none")
  state_readout: int = identity_lib.added(0)
  # causal: position t attends to positions <= t alone (the manual path).
  causal: bool = identity_lib.added(False)
  # ATTENTIONS: left out of identities (the paths agree to float rounding).
  attention: str = identity_lib.runtime("auto")

  def __post_init__(self):
    validation.require_positive(self, "vocab_size", "d_model", "num_heads",
                                "d_ff", "num_layers", "max_len")
    if self.d_model % self.num_heads:
      raise ValueError(f"MLMConfig.d_model = {self.d_model} must be divisible "
                       f"by num_heads = {self.num_heads}")
    validation.require_choices(self, pos_init=POS_INITS, rel_pos=REL_POS,
                               attention=ATTENTIONS)
    validation.require_ints(self, ["state_readout"], 0)
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"MLMConfig.dtype must be float32 or bfloat16, got "
                       f"{self.dtype!r}")

  @property
  def mask_id(self) -> int:
    return self.vocab_size

  @property
  def resolved_attention(self) -> str:
    """``attention``, ``"auto"`` resolved (call at trace time)."""
    if self.attention == "auto":
      return "manual" if jax.default_backend() == "cpu" else "dot_product"
    return self.attention

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)


class TokenDense(nn.Dense):
  """``nn.Dense`` on the input flattened to ``[N, D]``: the same values, a
  faster weight gradient on XLA:CPU (docs/performance.md)."""

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
    qkv_BxTx3xAxE = TokenDense(3 * d, dtype=dt, name="qkv")(y).reshape(
        b, t, 3, a, e)
    rows = slice(None) if query is None else slice(query, query + 1)
    # A prefix (prefix_init): keys and values before the tokens', without
    # a position (relative bias 0); the manual path only.
    prefix = (self.get_variable("prefix", "kv")
              if self.has_variable("prefix", "kv") else None)
    if (cfg.resolved_attention == "dot_product" and prefix is None
        and not cfg.causal):
      bias_1xAxTxT = (None if cfg.rel_pos == "none"
                      else rel_bias(cfg, t, self._rel_table())[None])
      out_BxTxAxE = dot_product_attention(
          qkv_BxTx3xAxE[:, :, 0], qkv_BxTx3xAxE[:, :, 1],
          qkv_BxTx3xAxE[:, :, 2], bias_1xAxTxT)
      x_BxTxD = (x_BxTxD + TokenDense(d, dtype=dt, name="attn_out")(
          out_BxTxAxE.reshape(b, t, d)))[:, rows]
    else:
      # Heads-major [3, B, A, T, E]: XLA:CPU runs the textbook [B, T, A, E]
      # einsums several times slower (experiments/bench/mlm.py).
      q, k, v = qkv_BxTx3xAxE.transpose(2, 0, 3, 1, 4)
      q = q[:, :, rows]  # [B, A, Q, E], Q = T or 1
      p = 0
      if prefix is not None:  # keys and values [B, A, P + T, E]
        p = prefix.shape[1]
        kv_2xBxAxPxE = jnp.broadcast_to(prefix.astype(dt).reshape(
            2, 1, p, a, e).transpose(0, 1, 3, 2, 4), (2, b, a, p, e))
        k = jnp.concatenate([kv_2xBxAxPxE[0], k], axis=2)
        v = jnp.concatenate([kv_2xBxAxPxE[1], v], axis=2)
      logits_BxAxQxT = jnp.matmul(q, jnp.swapaxes(k, -1, -2)) / jnp.sqrt(
          jnp.asarray(e, dt))
      if cfg.rel_pos != "none":
        bias_AxQxT = rel_bias(cfg, t, self._rel_table())[:, rows]
        if p:
          bias_AxQxT = jnp.pad(bias_AxQxT, ((0, 0), (0, 0), (p, 0)))
        logits_BxAxQxT = logits_BxAxQxT + bias_AxQxT.astype(dt)
      if cfg.causal:  # a key after its query (prefix keys: before all)
        later_QxT = (jnp.arange(t)[None, :] > jnp.arange(t)[rows, None])
        logits_BxAxQxT = jnp.where(jnp.pad(later_QxT, ((0, 0), (p, 0))),
                                   jnp.finfo(dt).min, logits_BxAxQxT)
      attn = jax.nn.softmax(logits_BxAxQxT.astype(jnp.float32), -1).astype(dt)
      out_BxAxQxE = jnp.matmul(attn, v)
      x_BxTxD = x_BxTxD[:, rows] + TokenDense(d, dtype=dt, name="attn_out")(
          out_BxAxQxE.transpose(0, 2, 1, 3).reshape(b, q.shape[2], d))
    y = nn.LayerNorm(dtype=dt, name="ln_mlp")(x_BxTxD)
    y = TokenDense(cfg.d_ff, dtype=dt, name="mlp_in")(y)
    y = TokenDense(d, dtype=dt, name="mlp_out")(nn.gelu(y))
    return x_BxTxD + y

  def _rel_table(self):
    """The learned ``[A, 2 max_len - 1]`` ``rel_bias`` param, or None."""
    if self.cfg.rel_pos != "bias":
      return None
    return self.param("rel_bias", nn.initializers.zeros,
                      (self.cfg.num_heads, 2 * self.cfg.max_len - 1))


def rel_bias(cfg: MLMConfig, t: int, table_AxO=None):
  """``[A, T, T]``: the relative-position term of the attention logits
  (``table_AxO``: the learned ``"bias"``, offsets ``-(L-1)..L-1``)."""
  offset_TxT = jnp.arange(t)[None, :] - jnp.arange(t)[:, None]
  if cfg.rel_pos == "alibi":
    slope_A = 2.0 ** (-8.0 * (jnp.arange(cfg.num_heads) + 1) / cfg.num_heads)
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
    pos_init = sinusoid_init if cfg.pos_init == "sinusoid" else init
    self.pos_embed = self.param("pos_embed", pos_init, (cfg.max_len, cfg.d_model))
    self.blocks = [Block(cfg, name=f"block_{i}") for i in range(cfg.num_layers)]
    self.ln_final = nn.LayerNorm(dtype=cfg.compute_dtype, name="ln_final")
    self.head = TokenDense(cfg.vocab_size, dtype=cfg.compute_dtype, name="head")
    if cfg.state_readout:
      self.state_head = TokenDense(cfg.state_readout, dtype=cfg.compute_dtype,
                                 name="state_head")

  def embed(self, tokens_BxT):
    ids = jnp.where(tokens_BxT == hmm_lib.MASK, self.cfg.mask_id, tokens_BxT)
    return self.tok_embed(ids)

  def encode(self, emb_BxTxD):
    return self.head(self.features(emb_BxTxD)).astype(jnp.float32)

  def encode_at(self, emb_BxTxD, query: int):
    """``encode(emb)[:, query]`` as ``[B, V]``, its last block on that row."""
    return self.head(self.features(emb_BxTxD, query)[:, 0]).astype(jnp.float32)

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


def prefix_init(key, params, length: int) -> dict:
  """A prefix of ``length`` positions for ``params``' layers (Li & Liang,
  no reparametrisation): ``{"prefix": {"block_i": {"kv": [2, length, D]}}}``,
  keys then values, heads concatenated, N(0, 0.02^2) (BERT's init); merged
  into the params (``{**params, **prefix}``) every layer attends to them."""
  names = _blocks(params)
  d = params["params"][names[0]]["qkv"]["kernel"].shape[0]
  keys = jax.random.split(key, len(names))
  return {"prefix": {n: {"kv": 0.02 * jax.random.normal(k, (2, length, d))}
                     for n, k in zip(names, keys)}}


def lora_init(key, params, rank: int, targets=("q", "v")) -> dict:
  """LoRA adapters (Hu et al.) of ``rank`` on each layer's ``targets``
  projections: ``{"block_i": {t: {"A": [D, r], "B": [r, D]}}}``, ``A``
  Uniform(+-1/sqrt(D)) (PEFT's kaiming init), ``B`` zero: at init
  :func:`with_lora` gives ``params`` exactly."""
  names = _blocks(params)
  d = params["params"][names[0]]["qkv"]["kernel"].shape[0]
  keys = jax.random.split(key, (len(names), len(targets)))
  return {n: {t: {"A": jax.random.uniform(keys[i, j], (d, rank),
                                          minval=-d**-0.5, maxval=d**-0.5),
                  "B": jnp.zeros((rank, d))} for j, t in enumerate(targets)}
          for i, n in enumerate(names)}


def with_lora(params, lora: dict, scale: float):
  """``params`` with ``scale * A @ B`` added to each adapted projection's
  columns of its layer's ``qkv`` kernel (``[D, 3D]``: q, k, v)."""
  inner = dict(params["params"])
  for name, adapters in lora.items():
    kernel = inner[name]["qkv"]["kernel"]
    d = kernel.shape[0]
    for t, ab in adapters.items():
      i = "qkv".index(t) * d
      kernel = kernel.at[:, i:i + d].add(scale * ab["A"] @ ab["B"])
    inner[name] = {**inner[name], "qkv": {**inner[name]["qkv"],
                                          "kernel": kernel}}
  return {**params, "params": inner}


def _blocks(params) -> list[str]:
  return sorted((n for n in params["params"] if n.startswith("block_")),
                key=lambda n: int(n.split("_")[1]))


def num_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


def train_flops_per_token(cfg: MLMConfig, seq_len: int) -> float:
  """Training FLOPs per token, for MFU: 6 x the matmul params plus 12 x
  layers x T x d (attention); embeddings, norms and softmaxes not counted."""
  d = cfg.d_model
  matmul_params = (cfg.num_layers * (4 * d * d + 2 * d * cfg.d_ff)
                   + d * cfg.vocab_size)
  return float(6 * matmul_params + 12 * cfg.num_layers * seq_len * d)


def make_backbone(cfg: MLMConfig, dtype: str = "float32") -> Backbone:
  """The backbone over ``MLM`` params, computing in ``dtype``, cached per
  config so that its models share compiled tuning programs."""
  return _cached_backbone(dataclasses.replace(cfg, dtype=dtype), dtype)


def build_backbone(cfg: MLMConfig, dtype: str = "float32") -> Backbone:
  """A new, uncached :func:`make_backbone` (new closures every call)."""
  cfg = dataclasses.replace(cfg, dtype=dtype)
  model = MLM(cfg)
  def embed(params, tokens_T):
    if not isinstance(tokens_T, jax.core.Tracer):
      hmm_lib.check_tokens(tokens_T, cfg.vocab_size)
    return model.apply(params, tokens_T[None], method=MLM.embed)[0]
  def apply(params, emb_TxD, index=None):  # apply_at: row index alone
    if emb_TxD.shape[0] > cfg.max_len:
      raise ValueError(f"input of {emb_TxD.shape[0]} positions exceeds the "
                       f"model's context max_len = {cfg.max_len}")
    logits = (model.apply(params, emb_TxD[None], method=MLM.encode)
              if index is None else
              model.apply(params, emb_TxD[None], index, method=MLM.encode_at))
    return jax.nn.softmax(logits[0], -1)
  return Backbone(name="transformer", embed=embed, apply=apply, apply_at=apply,
                  prompt_embedding=lambda raw: raw, embed_dim=cfg.d_model,
                  vocab_size=cfg.vocab_size, finetunable=True)


_cached_backbone = functools.lru_cache(maxsize=None)(build_backbone)
