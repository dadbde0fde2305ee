r"""The Bayes classifier's test accuracy on a Figure 3 setup's tasks: the
ceiling of the adaptation report (docs/adaptation.md).

  python -m experiments.bayes_ceiling --preset=adaptation --workdir=DIR

Every draw's test split labelled again, ``argmax mu @ P[Z_0 | x]``, the
posterior by a float64 numpy backward pass (a memory HMM as its product HMM):
a second path beside the jitted kernels. Writes DIR/bayes.jsonl, one line
per (panel, size), and redraws the report.
"""

import json
import os

from absl import app
from absl import flags
import numpy as np

from experiments import cli
from hmmprompt import files as files_lib
from hmmprompt import generative
from hmmprompt import memory
from hmmprompt import protocol
from hmmprompt.figure3 import adaptation
from hmmprompt.figure3 import configs
from hmmprompt.figure3 import reporting
from hmmprompt.figure3 import sweep

_PRESET = flags.DEFINE_enum("preset", "adaptation", list(configs.PRESETS),
                            "the Figure 3 preset whose tasks are labelled")
_CONFIG = cli.define_config(configs.PRESETS["cpu"]())
_WORKDIR = flags.DEFINE_string("workdir", None, "its Figure 3 workdir")
flags.adopt_module_key_flags(cli)


def posterior_first(initial, transition, emission, tokens_NxT) -> np.ndarray:
  """``[N, H]``: ``P[H_0 | x_1..T]`` (position 0 masked), float64 backward
  messages normalised at every step."""
  beta = np.ones((tokens_NxT.shape[0], initial.shape[0]))
  for t in range(tokens_NxT.shape[1] - 1, 0, -1):
    beta = (emission[:, tokens_NxT[:, t]].T * beta) @ transition.T
    beta /= beta.sum(-1, keepdims=True)
  post = initial * beta
  return post / post.sum(-1, keepdims=True)


def bayes_accuracy(model, task) -> float:
  """The label rule's accuracy on ``task``'s test split, recomputed."""
  is_memory = generative.is_memory(model)
  hmm = memory.to_hmm(model) if is_memory else model
  post = posterior_first(*(np.asarray(a, np.float64) for a in hmm),
                         np.asarray(task.test.tokens))
  if is_memory:  # states m |H| + h: the memory is the leading index
    post = post.reshape(post.shape[0], model.memory_prior.shape[0], -1).sum(-1)
  labels = np.argmax(post @ np.asarray(task.mu, np.float64).T, -1)
  return float(np.mean(labels == np.asarray(task.test.labels)))


@cli.one_line_errors
def main(argv):
  t0, workdir = cli.start(argv, workdir=_WORKDIR.value), _WORKDIR.value
  with cli.usage_errors():
    setup = configs.get_setup(_PRESET.value, _CONFIG.value())
    if setup.task.labeling != "paper":
      raise ValueError("--config.task.labeling must be 'paper'")
    sweep.check_workdir(cli.make_dir(workdir), setup)
  out, plan = [], configs.plan(setup)
  for mid, num in configs.stack_sizes(setup).items():
    stack = protocol.draw_stack(setup, mid, num, setup.tasks_per_hmm)
    acc = [bayes_accuracy(generative.trial(stack.models_K, k), t)
           for k, row in enumerate(stack.tasks) for t in row]
    for panel in sorted({g.panel for g in plan[mid]}):
      out.append({"panel": panel, "size": mid.size, "tasks": len(acc),
                  "accuracy": 100 * float(np.mean(acc)),
                  "lowest": 100 * float(np.min(acc))})
      print(json.dumps(out[-1]))
  files_lib.atomic_write_text(os.path.join(workdir, adaptation.BAYES), "".join(
      json.dumps(d, sort_keys=True) + "\n" for d in out))
  reporting.write_figure3_report(workdir)
  cli.done(t0, ceiling=os.path.join(workdir, adaptation.BAYES))


if __name__ == "__main__":
  app.run(main)
