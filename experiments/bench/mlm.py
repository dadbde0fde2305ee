r"""Train-step throughput: our Flax MLM vs HuggingFace's PyTorch
``BertForMaskedLM`` (what the authors used), same config, same device, one run.

  python -m experiments.bench.mlm [--preset=cpu|paper|...] \
      [--config.model.d_model=64 --config.batch_size=32 \
       --config.corpus.chunk_len=128 --config.model.max_len=128 ...]
  # needs the `bench` extra (torch, transformers)

A full AdamW step at a pretraining preset's shape (docs/performance.md);
MFU against ``--peak_tflops`` (default: a known GPU's, none on CPU).
"""

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
_PEAK = flags.DEFINE_float("peak_tflops", None,
                           "device peak for MFU (default: known GPUs)")
_SKIP_HF = flags.DEFINE_bool("skip_hf", False, "time our model only")
_STEPS = flags.DEFINE_integer("steps", 30, "timed steps per repeat")
_REPEATS = flags.DEFINE_integer("repeats", 3, "repeats (median)")
_EXACT = flags.DEFINE_bool("exact", True, "also time our step with "
                           "exact-conditional targets")
_OTHER_ATTENTION = flags.DEFINE_bool(
    "other_attention", True, "also time our step with the other attention "
    "path (--config.model.attention picks the first; auto: manual on CPU, "
    "dot_product elsewhere)")
_NUM_STATES = flags.DEFINE_integer("num_states", 30, "HMM states for the "
                                   "exact targets")
_RETAIN = flags.DEFINE_bool(
    "retain_freed_memory", True, "glibc.retain_freed_memory() first "
    "(as the binaries do); false times glibc's defaults")
_THREADS = flags.DEFINE_integer("torch_threads", 0,
                                "torch intra-op threads (0: its default)")


_MODEL_KEYS = ("d_model", "num_layers", "num_heads", "d_ff", "dtype",
               "attention")


def resolve_shape() -> dict:
  """The preset's model, batch and context with overrides; validated."""
  with cli.usage_errors():
    cfg = config_flags.apply(pretrain.configure(_PRESET.value),
                             _CONFIG.value())
  return {**{k: getattr(cfg.model, k) for k in _MODEL_KEYS},
          "seq_len": cfg.corpus.chunk_len, "batch_size": cfg.batch_size}


def model_config(shape: dict, vocab: int) -> transformer.MLMConfig:
  return transformer.MLMConfig(vocab_size=vocab, max_len=shape["seq_len"],
                               **{k: shape[k] for k in _MODEL_KEYS})


def _time(step_fn, sync=jax.block_until_ready) -> float:
  return harness.seconds_per_call(step_fn, _REPEATS.value, _STEPS.value,
                                  sync=sync)


def bench_ours(shape: dict, vocab=10, targets="sampled"):
  """Our step (``targets="exact"``: on an ``|H| = --num_states`` HMM)."""
  b, t = shape["batch_size"], shape["seq_len"]
  cfg = pretrain.PretrainConfig(
      model=model_config(shape, vocab),
      corpus=corpus_lib.CorpusConfig(chunk_len=t, fresh=True),
      lr=1e-3, batch_size=b, steps=10**6, targets=targets)
  model = hmm.random_hmm(jax.random.PRNGKey(2), _NUM_STATES.value, vocab)
  mesh = sharding.data_mesh()
  # One model: a stack of one (the unbatched body inside the step).
  state = jax.device_put(pretrain.init_states(jax.random.PRNGKey(0)[None],
                                              cfg), sharding.replicated(mesh))
  n_params = transformer.num_params(jax.tree.map(lambda x: x[0], state.params))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, vocab, (1, b, t)), jnp.int32)
  inputs, weights = corpus_lib.mask_tokens(jax.random.PRNGKey(1), tokens,
                                           0.15, vocab)
  return _time(harness.train_steps(
      pretrain.make_train_step(cfg, mesh), lambda _: (inputs, tokens, weights),
      state, jax.tree.map(lambda x: x[None], model))), n_params


def bench_hf(shape: dict, vocab=10):
  import torch  # pylint: disable=g-import-not-at-top
  from transformers import BertConfig, BertForMaskedLM  # pylint: disable=g-import-not-at-top
  if _THREADS.value:
    torch.set_num_threads(_THREADS.value)
  device = "cuda" if torch.cuda.is_available() else "cpu"
  b, t = shape["batch_size"], shape["seq_len"]
  cfg = BertConfig(vocab_size=vocab + 1, hidden_size=shape["d_model"],
                   num_hidden_layers=shape["num_layers"],
                   num_attention_heads=shape["num_heads"],
                   intermediate_size=shape["d_ff"],
                   max_position_embeddings=t,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
  model = BertForMaskedLM(cfg).to(device).train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
  gen = torch.Generator().manual_seed(0)
  ids = torch.randint(0, vocab, (b, t), generator=gen)
  labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.15, ids,
                       torch.full_like(ids, -100))
  ids, labels = ids.to(device), labels.to(device)
  autocast = torch.autocast(device, dtype=torch.bfloat16,
                            enabled=shape["dtype"] == "bfloat16")

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

  n_params = sum(p.numel() for p in model.parameters())
  desc = f"torch {torch.__version__}, " + (
      torch.cuda.get_device_name() if device == "cuda"
      else f"{torch.get_num_threads()} threads")
  return _time(step_fn, sync), n_params, desc


@harness.main(retain_freed_memory=lambda: _RETAIN.value)
def main():
  shape = resolve_shape()
  vocab = 10
  tokens = shape["batch_size"] * shape["seq_len"]
  flops = (transformer.train_flops_per_token(model_config(shape, vocab),
                                             shape["seq_len"]) * tokens)
  peak = harness.peak_tflops(shape["dtype"], _PEAK.value)
  print(f"MLM train step, d={shape['d_model']} layers={shape['num_layers']} "
        f"heads={shape['num_heads']} T={shape['seq_len']} "
        f"B={shape['batch_size']} {shape['dtype']}; jax {jax.__version__} on "
        f"{jax.devices()[0].device_kind}; {flops / 1e9:.1f} GFLOP/step"
        + (f"; peak {peak:.0f} TFLOP/s" if peak else ""))

  def report(name, sec, n_params, extra=""):
    print(f"  {name:22s} {tokens / sec / 1e3:9.1f}k tokens/s "
          f"({n_params} params, {1e3 * sec:.2f} ms/step, "
          f"{harness.describe(flops, sec, peak)}{extra})")
  t_ours, n_ours = bench_ours(shape, vocab)
  attention = model_config(shape, vocab).resolved_attention
  report("hmmprompt Flax MLM", t_ours, n_ours, f", attention={attention}")
  if _OTHER_ATTENTION.value:
    other = "manual" if attention == "dot_product" else "dot_product"
    t_other, _ = bench_ours({**shape, "attention": other}, vocab)
    report(f"  attention={other}", t_other, n_ours,
           f", {t_other / t_ours:.2f}x the time")
  if _EXACT.value:
    t_exact, _ = bench_ours(shape, vocab, "exact")
    report("  with exact targets", t_exact, n_ours,
           f", |H| = {_NUM_STATES.value}, {t_exact / t_ours:.2f}x the time")
  if _SKIP_HF.value:
    return
  try:
    t_hf, n_hf, desc = bench_hf(shape, vocab)
  except ImportError:
    return print("  torch/transformers not installed (pip install -e "
                 "'.[bench]')")
  report("HF BertForMaskedLM", t_hf, n_hf, f", {desc}")
  print(f"  ratio (ours / HF):      {t_hf / t_ours:9.2f}x")


if __name__ == "__main__":
  app.run(main)
