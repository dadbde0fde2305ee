r"""A full AdamW step at a preset's shape, in one run: our Flax MLM vs the
authors', HuggingFace's PyTorch ``BertForMaskedLM`` (docs/performance.md).

  python -m experiments.bench.mlm [--preset=cpu|paper|...] \
      [--config.model.d_model=64 --config.batch_size=32 ...]  # `bench` extra
"""

import dataclasses

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import cli
from experiments.bench import harness
from hmmprompt import config_flags
from hmmprompt import corpus as corpus_lib
from hmmprompt import hmm
from hmmprompt import pretrain
from hmmprompt import sharding
from hmmprompt.backbones import transformer

_PRESET = flags.DEFINE_enum("preset", "cpu", list(pretrain.PRESETS),
                            "pretraining preset whose step is timed")
_CONFIG = cli.define_config(pretrain.preset_config("cpu"))
flags.adopt_module_key_flags(cli)
_PEAK = flags.DEFINE_float("peak_tflops", None, "MFU's peak (default: GPUs')")
_SKIP_HF = flags.DEFINE_bool("skip_hf", False, "time our model only")
_STEPS = flags.DEFINE_integer("steps", 30, "timed steps per repeat")
_REPEATS = flags.DEFINE_integer("repeats", 3, "repeats (median)")
_EXACT = flags.DEFINE_bool("exact", True, "also time exact targets")
_OTHER_ATTENTION = flags.DEFINE_bool("other_attention", True, "also time "
                                     "the attention path not chosen")
_NUM_STATES = flags.DEFINE_integer("num_states", 30, "exact targets' |H|")
_RETAIN = flags.DEFINE_bool("retain_freed_memory", True, "glibc's setting "
                            "as the binaries'; false: glibc's defaults")
_THREADS = flags.DEFINE_integer("torch_threads", 0, "torch's (0: its default)")
VOCAB = 10


def bench_ours(m: transformer.MLMConfig, b: int, targets="sampled"):
  """Our step's seconds and parameters."""
  cfg = pretrain.PretrainConfig(
      model=m, corpus=corpus_lib.CorpusConfig(chunk_len=m.max_len, fresh=True),
      lr=1e-3, batch_size=b, steps=10**6, targets=targets)
  model = hmm.random_hmm(jax.random.PRNGKey(2), _NUM_STATES.value, VOCAB)
  mesh = sharding.data_mesh()
  # One model: a stack of one (the unbatched body inside the step).
  state = jax.device_put(pretrain.init_states(jax.random.PRNGKey(0)[None],
                                              cfg), sharding.replicated(mesh))
  # Counted now: the step donates the state's buffers.
  n_params = transformer.num_params(jax.tree.map(lambda x: x[0], state.params))
  tokens = jnp.asarray(np.random.default_rng(0).integers(
      0, VOCAB, (1, b, m.max_len)), jnp.int32)
  inputs, weights = corpus_lib.mask_tokens(jax.random.PRNGKey(1), tokens,
                                           0.15, VOCAB)
  return harness.seconds_per_call(harness.train_steps(
      pretrain.make_train_step(cfg, mesh), lambda _: (inputs, tokens, weights),
      state, jax.tree.map(lambda x: x[None], model)), _REPEATS.value,
      _STEPS.value), n_params


def bench_hf(m: transformer.MLMConfig, b: int):
  import torch  # pylint: disable=g-import-not-at-top
  from transformers import BertConfig, BertForMaskedLM  # pylint: disable=g-import-not-at-top
  if _THREADS.value:
    torch.set_num_threads(_THREADS.value)
  device = "cuda" if torch.cuda.is_available() else "cpu"
  model = BertForMaskedLM(BertConfig(
      vocab_size=VOCAB + 1, hidden_size=m.d_model, intermediate_size=m.d_ff,
      num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
      max_position_embeddings=m.max_len, hidden_dropout_prob=0.0,
      attention_probs_dropout_prob=0.0)).to(device).train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
  gen = torch.Generator().manual_seed(0)
  ids = torch.randint(0, VOCAB, (b, m.max_len), generator=gen)
  labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.15, ids,
                       torch.full_like(ids, -100))
  ids, labels = ids.to(device), labels.to(device)
  autocast = torch.autocast(device, dtype=torch.bfloat16,
                            enabled=m.dtype == "bfloat16")
  def step_fn():
    opt.zero_grad(set_to_none=True)
    with autocast:
      loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    opt.step()
    return loss
  def sync(out):
    out.item()
    if device == "cuda":
      torch.cuda.synchronize()
  secs = harness.seconds_per_call(step_fn, _REPEATS.value, _STEPS.value,
                                  sync=sync)
  return secs, sum(p.numel() for p in model.parameters()), (
      f"torch {torch.__version__}, " + (
          torch.cuda.get_device_name() if device == "cuda"
          else f"{torch.get_num_threads()} threads"))


def main(argv):
  harness.start(argv, _RETAIN.value)
  with cli.usage_errors():
    cfg = config_flags.apply(pretrain.configure(_PRESET.value), _CONFIG.value())
  # The preset's model (its context as max_len) and batch.
  keys = ("d_model", "num_layers", "num_heads", "d_ff", "dtype", "attention")
  m = transformer.MLMConfig(vocab_size=VOCAB, max_len=cfg.corpus.chunk_len,
                            **{k: getattr(cfg.model, k) for k in keys})
  b, tokens = cfg.batch_size, cfg.batch_size * m.max_len
  flops = transformer.train_flops_per_token(m, m.max_len) * tokens
  peak = harness.peak_tflops(m.dtype, _PEAK.value)
  print(f"MLM train step, d={m.d_model} layers={m.num_layers} heads="
        f"{m.num_heads} T={m.max_len} B={b} {m.dtype}; jax {jax.__version__} "
        f"on {jax.devices()[0].device_kind}; {flops / 1e9:.1f} GFLOP/step"
        + (f"; peak {peak:.0f} TFLOP/s" if peak else ""))
  def report(name, sec, n_params, extra=""):
    print(f"  {name:22s} {tokens / sec / 1e3:9.1f}k tokens/s "
          f"({n_params} params, {1e3 * sec:.2f} ms/step, "
          f"{harness.describe(flops, sec, peak)}{extra})")
  t_ours, n_ours = bench_ours(m, b)
  attention = m.resolved_attention
  report("hmmprompt Flax MLM", t_ours, n_ours, f", attention={attention}")
  if _OTHER_ATTENTION.value:
    other = "manual" if attention == "dot_product" else "dot_product"
    t_other, _ = bench_ours(dataclasses.replace(m, attention=other), b)
    report(f"  attention={other}", t_other, n_ours,
           f", {t_other / t_ours:.2f}x the time")
  if _EXACT.value:
    t_exact, _ = bench_ours(m, b, "exact")
    report("  with exact targets", t_exact, n_ours,
           f", |H| = {_NUM_STATES.value}, {t_exact / t_ours:.2f}x the time")
  if _SKIP_HF.value:
    return
  try:
    t_hf, n_hf, desc = bench_hf(m, b)
  except ImportError:
    return print("  torch/transformers", harness.NO_BENCH)
  report("HF BertForMaskedLM", t_hf, n_hf, f", {desc}")
  print(f"  ratio (ours / HF):      {t_hf / t_ours:9.2f}x")


if __name__ == "__main__":
  app.run(main)
