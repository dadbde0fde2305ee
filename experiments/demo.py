r"""Short demo of the HMM core (`./launch.sh demo`): an Appendix D HMM, its
text, exact posteriors, the exact masked-LM loss, a task, a memory HMM.

  python -m experiments.demo [--num_states=10] [--seed=0]
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

_STATES = flags.DEFINE_integer("num_states", 10, "states |H|", lower_bound=1)
_VOCAB = flags.DEFINE_integer("vocab_size", 10, "vocabulary |X|", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed")
_NUM_SEQS = flags.DEFINE_integer("num_seqs", 200, "sequences", lower_bound=1)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 512, "their tokens", lower_bound=1)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  np.set_printoptions(precision=3, suppress=True)
  k_hmm, k_seq, k_task, k_mem = jax.random.split(
      jax.random.PRNGKey(_SEED.value), 4)
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
  post = hmm_lib.posterior(model, tokens_BxT[0])
  print(f"\nfirst tokens       {np.asarray(x)}\ntrue states        "
        f"{np.asarray(states_BxT[0, :8])}\nargmax P[H_t | x]  "
        f"{np.asarray(jnp.argmax(post[:8], -1))}")
  masked = x.at[3].set(hmm_lib.MASK)
  print(f"P[X_3 | x_-3] with x_3 = {int(x[3])} masked: "
        f"{np.asarray(hmm_lib.conditionals(model, masked)[3])}")
  cond_BxTxV = jax.jit(jax.vmap(hmm_lib.conditionals, in_axes=(None, 0)))(
      model, tokens_BxT)
  p_true = jnp.take_along_axis(cond_BxTxV, tokens_BxT[..., None], -1)[..., 0]
  unigram = np.bincount(np.asarray(tokens_BxT).ravel(),
                        minlength=model.vocab_size) / tokens_BxT.size
  print(f"\nexact masked-LM cross-entropy (one position masked): "
        f"{float(-jnp.mean(jnp.log(p_true))):.4f} nats/token; unigram "
        f"entropy {-np.sum(unigram * np.log(np.maximum(unigram, 1e-30))):.4f}")
  cfg, t0 = tasks.TaskConfig(), time.perf_counter()
  task = tasks.make_task(k_task, model, cfg)
  share = np.bincount(task.test.labels, minlength=2) / cfg.num_test
  print(f"\ndownstream task: {cfg.num_train}/{cfg.num_val}/{cfg.num_test} "
        f"examples of length {cfg.seq_len + 1}, re-drawn {task.redraws} "
        f"time(s), test label shares {share}, {time.perf_counter() - t0:.1f} s")
  mhmm = memory_lib.random_memory_hmm(k_mem, 5, 4, _VOCAB.value)
  mem_tokens, _, memory = memory_lib.sample(k_mem, mhmm, 128)
  post = memory_lib.memory_posterior(mhmm, mem_tokens)
  print(f"\nmemory HMM |M|=5, |H|=4: true memory {int(memory)}, "
        f"P[M | x_1:128] = {np.asarray(post)}")


if __name__ == "__main__":
  app.run(main)
