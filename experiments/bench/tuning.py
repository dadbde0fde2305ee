r"""Prompt tuning on a transformer: the MASK's row alone in the last block
(``Backbone.apply_at``, as shipped) against the full forward sliced after.

  python -m experiments.bench.tuning [--preset=cpu_paper] [--lanes=4] \
      [--rounds=3]

A random-init transformer of the preset's, an ``|H|`` = 30 task, prompt
tuning of ``--lanes`` seeds in one program (docs/performance.md).
"""

import dataclasses
import functools

from absl import app
from absl import flags
import jax

from hmmprompt import figure3
from hmmprompt import generative
from hmmprompt import protocol
from hmmprompt import tasks
from hmmprompt import tuning
from hmmprompt.backbones import transformer
from experiments.bench import harness

_PRESET = flags.DEFINE_string("preset", "cpu_paper", "figure3 preset")
_LANES = flags.DEFINE_integer("lanes", 4, "seeds tuned in one program")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "timed runs of each arm")


@harness.main()
def main():
  setup = figure3.get_setup(_PRESET.value)
  model = generative.as_hmm(generative.random_model(
      jax.random.PRNGKey(0), "vanilla", 30, protocol.VOCAB))
  task = tasks.make_task(jax.random.PRNGKey(1), model, setup.task)
  cfg = dataclasses.replace(setup.tune, method="prompt")
  lanes = _LANES.value
  data = jax.tree.map(lambda x: jax.numpy.stack([x] * lanes),
                      tuning.data_from_task(task, cfg))
  keys = jax.random.split(jax.random.PRNGKey(2), lanes)
  params = transformer.init_params(jax.random.PRNGKey(3), setup.pretrain.model)
  at = transformer.build_backbone(setup.pretrain.model)
  arms = {"full forward (baseline)": dataclasses.replace(at, apply_at=None),
          "MASK row in the last block": at}
  spent = harness.interleaved({name: functools.partial(
      tuning.tune, keys, bb, params, data, cfg) for name, bb in arms.items()},
                          _ROUNDS.value)
  print(f"{_PRESET.value}: prompt tuning, {lanes} lanes, "
        f"{setup.task.num_train} examples x {cfg.epochs} epochs, "
        f"{jax.default_backend()}")
  for name, s in spent.items():
    print(f"{name:28s} {s / _ROUNDS.value / lanes:6.2f} s per lane")
  base, new = spent.values()
  print(f"ratio: {base / new:.2f}x faster")


if __name__ == "__main__":
  app.run(main)
