r"""Short demo of the HMM core (`./launch.sh demo`).

  python -m experiments.demo [--num_states=10] [--seed=0]

An Appendix D HMM, its text, exact posteriors and the exact masked-LM
cross-entropy, then a downstream task and a memory HMM.
"""

import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import hmm as hmm_lib
from hmmprompt import memory as memory_lib
from hmmprompt import tasks

_STATES = flags.DEFINE_integer("num_states", 10, "hidden states |H|")
_VOCAB = flags.DEFINE_integer("vocab_size", 10, "vocabulary |X|")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed")
_NUM_SEQS = flags.DEFINE_integer("num_seqs", 200, "sequences for the MLM loss")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 512, "tokens per sequence")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  for name, flag in (("num_states", _STATES), ("vocab_size", _VOCAB),
                     ("num_seqs", _NUM_SEQS), ("seq_len", _SEQ_LEN)):
    if flag.value < 1:
      raise app.UsageError(f"--{name} must be >= 1, got {flag.value}")
  np.set_printoptions(precision=3, suppress=True)
  key = jax.random.PRNGKey(_SEED.value)
  k_hmm, k_seq, k_task, k_mem = jax.random.split(key, 4)
  model = hmm_lib.random_hmm(k_hmm, _STATES.value, _VOCAB.value)
  print(f"HMM: |H|={model.num_states}, |X|={model.vocab_size} (Appendix D "
        f"generator, seed {_SEED.value})")

  t0 = time.perf_counter()
  tokens_BxT, states_BxT = jax.block_until_ready(jax.jit(jax.vmap(
      lambda k: hmm_lib.sample(k, model, _SEQ_LEN.value)))(
          jax.random.split(k_seq, _NUM_SEQS.value)))
  print(f"sampled {tokens_BxT.size} tokens in "
        f"{time.perf_counter() - t0:.2f} s (including compilation)")

  x = tokens_BxT[0, :8]
  print(f"\nfirst tokens       {np.asarray(x)}")
  print(f"true states        {np.asarray(states_BxT[0, :8])}")
  post = hmm_lib.posterior(model, tokens_BxT[0])
  print(f"argmax P[H_t | x]  {np.asarray(jnp.argmax(post[:8], -1))}")
  masked = x.at[3].set(hmm_lib.MASK)
  print(f"P[X_3 | x_-3] with x_3 = {int(x[3])} masked: "
        f"{np.asarray(hmm_lib.conditionals(model, masked)[3])}")

  cond_BxTxV = jax.jit(jax.vmap(hmm_lib.conditionals, in_axes=(None, 0)))(
      model, tokens_BxT)
  p_true = jnp.take_along_axis(cond_BxTxV, tokens_BxT[..., None], -1)[..., 0]
  bayes_ce = float(-jnp.mean(jnp.log(p_true)))
  unigram = np.bincount(np.asarray(tokens_BxT).ravel(),
                        minlength=model.vocab_size) / tokens_BxT.size
  unigram_ce = float(-np.sum(unigram * np.log(np.maximum(unigram, 1e-30))))
  print(f"\nexact masked-LM cross-entropy (one position masked): "
        f"{bayes_ce:.4f} nats/token; unigram entropy {unigram_ce:.4f}")

  cfg = tasks.TaskConfig()
  t0 = time.perf_counter()
  task = tasks.make_task(k_task, model, cfg)
  print(f"\ndownstream task: {cfg.num_train}/{cfg.num_val}/{cfg.num_test} "
        f"examples of length {cfg.seq_len + 1}, re-drawn {task.redraws} "
        f"time(s), test label shares "
        f"{np.bincount(task.test.labels, minlength=2) / cfg.num_test}, "
        f"{time.perf_counter() - t0:.1f} s")

  mhmm = memory_lib.random_memory_hmm(k_mem, 5, 4, _VOCAB.value)
  mem_tokens, _, memory = memory_lib.sample(k_mem, mhmm, 128)
  print(f"\nmemory HMM |M|=5, |H|=4: true memory {int(memory)}, "
        f"P[M | x_1:128] = {np.asarray(memory_lib.memory_posterior(mhmm, mem_tokens))}")


if __name__ == "__main__":
  app.run(main)
