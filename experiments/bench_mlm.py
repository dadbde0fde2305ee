r"""Train-step throughput: our Flax MLM vs HuggingFace's PyTorch
``BertForMaskedLM`` (what the authors used), same config, same CPU, one run.

  python -m experiments.bench_mlm [--d_model=64 --num_layers=2 --seq_len=128
                                   --batch_size=32]   # needs the `bench` extra

Both sides run a full AdamW step (forward, backward, update) on the same
shapes with 15% of positions predicted; the HF model gets the matching
hidden size, heads, MLP width, layers and vocabulary, dropout off.
"""

import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import corpus as corpus_lib
from hmmprompt import pretrain
from hmmprompt import sharding
from hmmprompt.backbones import transformer

_D = flags.DEFINE_integer("d_model", 64, "width")
_L = flags.DEFINE_integer("num_layers", 2, "layers")
_H = flags.DEFINE_integer("num_heads", 2, "heads")
_T = flags.DEFINE_integer("seq_len", 128, "sequence length")
_B = flags.DEFINE_integer("batch_size", 32, "batch size")
_STEPS = flags.DEFINE_integer("steps", 30, "timed steps per repeat")
_REPEATS = flags.DEFINE_integer("repeats", 3, "repeats (median)")
_THREADS = flags.DEFINE_integer("torch_threads", 0,
                                "torch intra-op threads (0: its default)")


def bench_ours(vocab=10):
  cfg = pretrain.PretrainConfig(
      model=transformer.MLMConfig(vocab_size=vocab, d_model=_D.value,
                                  num_heads=_H.value, d_ff=4 * _D.value,
                                  num_layers=_L.value, max_len=_T.value),
      corpus=corpus_lib.CorpusConfig(chunk_len=_T.value, fresh=True),
      lr=1e-3, batch_size=_B.value, steps=10**6)
  mesh = sharding.data_mesh()
  state = jax.device_put(pretrain.init_state(jax.random.PRNGKey(0), cfg),
                         sharding.replicated(mesh))
  step = pretrain.make_train_step(cfg, mesh)
  rng = np.random.default_rng(0)
  targets = jnp.asarray(rng.integers(0, vocab, (_B.value, _T.value)),
                        jnp.int32)
  inputs, weights = corpus_lib.mask_tokens(jax.random.PRNGKey(1), targets,
                                           0.15, vocab)
  state, loss = step(state, inputs, targets, weights)
  jax.block_until_ready(loss)
  times = []
  for _ in range(_REPEATS.value):
    t0 = time.perf_counter()
    for _ in range(_STEPS.value):
      state, loss = step(state, inputs, targets, weights)
    jax.block_until_ready(loss)
    times.append((time.perf_counter() - t0) / _STEPS.value)
  return float(np.median(times)), transformer.num_params(state["params"])


def bench_hf(vocab=10):
  import torch  # pylint: disable=g-import-not-at-top
  from transformers import BertConfig, BertForMaskedLM  # pylint: disable=g-import-not-at-top
  if _THREADS.value:
    torch.set_num_threads(_THREADS.value)
  cfg = BertConfig(vocab_size=vocab + 1, hidden_size=_D.value,
                   num_hidden_layers=_L.value,
                   num_attention_heads=_H.value,
                   intermediate_size=4 * _D.value,
                   max_position_embeddings=_T.value,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
  model = BertForMaskedLM(cfg)
  model.train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
  gen = torch.Generator().manual_seed(0)
  ids = torch.randint(0, vocab, (_B.value, _T.value), generator=gen)
  labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.15, ids,
                       torch.full_like(ids, -100))

  def step():
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    opt.step()
    return loss

  step()
  times = []
  for _ in range(_REPEATS.value):
    t0 = time.perf_counter()
    for _ in range(_STEPS.value):
      step()
    times.append((time.perf_counter() - t0) / _STEPS.value)
  n_params = sum(p.numel() for p in model.parameters())
  return float(np.median(times)), n_params, torch.__version__, torch.get_num_threads()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  tokens = _B.value * _T.value
  print(f"MLM train step, d={_D.value} layers={_L.value} heads={_H.value} "
        f"T={_T.value} B={_B.value}; jax {jax.__version__} on "
        f"{jax.default_backend()}")
  t_ours, n_ours = bench_ours()
  print(f"  hmmprompt Flax MLM      {tokens / t_ours / 1e3:9.1f}k tokens/s "
        f"({n_ours} params, {1e3 * t_ours:.1f} ms/step)")
  try:
    t_hf, n_hf, version, threads = bench_hf()
  except ImportError:
    print("  torch/transformers not installed (pip install -e '.[bench]')")
    return
  print(f"  HF BertForMaskedLM      {tokens / t_hf / 1e3:9.1f}k tokens/s "
        f"({n_hf} params, {1e3 * t_hf:.1f} ms/step, torch {version}, "
        f"{threads} threads)")
  print(f"  ratio (ours / HF):      {t_hf / t_ours:9.2f}x")


if __name__ == "__main__":
  app.run(main)
