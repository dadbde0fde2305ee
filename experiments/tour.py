"""The README's tour, runnable (tests/test_tour.py: the README shows it)."""

# README tour: begin
import tempfile

import jax
import jax.numpy as jnp
from hmmprompt import hmm, pretrain, tasks, tuning
from hmmprompt.backbones import exact

model = hmm.random_hmm(jax.random.PRNGKey(0), num_states=30, vocab_size=10)
tokens, states = hmm.sample(jax.random.PRNGKey(1), model, 129)
tokens = tokens.at[0].set(hmm.MASK)          # MASK = -1: unobserved position
hmm.posterior(model, tokens)                 # [T, H]  P[H_t | observed]
hmm.conditionals(model, tokens)              # [T, V]  P[X_t | x_{-t}]: the exact MLM G

# Batches: vmap. Everything is jittable, vmappable and differentiable.
# Under jit or vmap nothing can look at values: a token out of range makes
# its sequence impossible (an all-zero posterior, log-likelihood -inf).
# Check a batch up front with hmm.check_tokens.
keys = jax.random.split(jax.random.PRNGKey(2), 8)
batch_BxT = jax.vmap(lambda k: hmm.sample(k, model, 129)[0])(keys)
hmm.check_tokens(batch_BxT, model.vocab_size)
post_BxTxH = jax.jit(jax.vmap(hmm.posterior, in_axes=(None, 0)))(model, batch_BxT)

# Sequences of several lengths: right-pad each with MASK to one length
# (never left-pad). The padding marginalises out: each row's first n
# posteriors and its log-likelihood are its n tokens' own.
lengths = [40, 129, 75]
padded_BxT = jnp.where(jnp.arange(129) < jnp.array(lengths)[:, None],
                       batch_BxT[:3], hmm.MASK)
post_BxTxH = jax.vmap(hmm.posterior, in_axes=(None, 0))(model, padded_BxT)
loglik_B = jax.vmap(hmm.log_likelihood, in_axes=(None, 0))(model, padded_BxT)
same = all(
    jnp.allclose(post_BxTxH[i, :n], hmm.posterior(model, batch_BxT[i, :n]),
                 atol=1e-5)
    and jnp.allclose(loglik_B[i], hmm.log_likelihood(model, batch_BxT[i, :n]))
    for i, n in enumerate(lengths))
print(f"right-padded = unpadded: {same}")

# Head vs prompt tuning on the exact backbone (perfect pretraining), on a
# task of 2000 / 500 / 1000 examples of 59 tokens (the CPU protocol's).
backbone, params = exact.make(model)
task_cfg = tasks.TaskConfig(num_train=2000, seq_len=59)
task = tasks.make_task(jax.random.PRNGKey(3), model, task_cfg)  # mu [2, H]; splits
for method in ("head", "prompt"):
  cfg = tuning.TuneConfig(method=method)               # the paper's defaults otherwise
  result, tunable = tuning.tune(jax.random.PRNGKey(4), backbone, params,
                                tuning.data_from_task(task, cfg), cfg)
  print(f"exact {method} {result.test_accuracy:.3f}")   # a typed Result of host arrays

# The same with a transformer pretrained on the HMM's text: 2 layers of
# width 64, context 80 = 20 prompt vectors + MASK + 59 tokens (the main
# job's recipe; it stops within 0.04 nats of the Bayes CE, here at step
# 250).
workdir = tempfile.mkdtemp()
pretrain.run(workdir, pretrain.configure("cpu_capped"), model)
backbone, params, info = pretrain.load_backbone(workdir)
print(f"step {info.step}: {info.metrics['ce_gap']:.3f} nats above the Bayes CE")
for method in ("head", "prompt"):
  cfg = tuning.TuneConfig(method=method)
  result, tunable = tuning.tune(jax.random.PRNGKey(4), backbone, params,
                                tuning.data_from_task(task, cfg), cfg)
  print(f"transformer {method} {result.test_accuracy:.3f}")
# README tour: end
