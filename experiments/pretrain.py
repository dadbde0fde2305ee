r"""Pretrain the masked LM on text from an HMM (docs/pretraining.md).

  python -m experiments.pretrain --preset=tiny|cpu|cpu_capped|cpu_adamw|paper \
      --workdir=DIR [--config.model_kind=memory --config.memory_size=3] \
      [--config.num_states=10] [--config.hmm_seed=0] [--config.trials=K] \
      [--config.pretrain.lr=3e-3 --config.pretrain.model.num_heads=4 ...]

Every field of the Job is a ``--config.<path>`` flag (``--helpfull`` lists
them); a rerun resumes; ``--distributed``: docs/multihost.md.
"""

import os
import signal

from absl import app
from absl import flags
from absl import logging
import jax

from experiments import cli
from hmmprompt import pretrain
from hmmprompt import sharding
from hmmprompt.pretrain import workdir as workdir_lib
from hmmprompt.backbones import transformer

_PRESET = flags.DEFINE_enum("preset", "cpu", list(pretrain.PRESETS),
                            "pretraining preset")
_CONFIG = cli.define_config(pretrain.Job(
    pretrain=pretrain.preset_config("cpu")))
_WORKDIR = flags.DEFINE_string("workdir", None, "output; a rerun resumes")
_PRINT_CONFIG = cli.define_print_config()
_CRASH_AT = flags.DEFINE_integer("crash_at_step", None, "testing: "
                                 "--crash_signal this process after this step")
_CRASH_SIGNAL = flags.DEFINE_enum("crash_signal", "SIGKILL",
                                  ["SIGKILL", "SIGTERM"], "testing: see above")
_INIT_DISTRIBUTED = cli.define_distributed_flags()
flags.adopt_module_key_flags(cli)

# A final evaluation's fields as printed, in this order (the rest left out).
_SHOWN = {"step": "step {}", "ce_gap": "ce_gap {:.4f}", "tv": "tv {:.4f}",
          "mlm_ce": "mlm_ce {:.4f}", "bayes_ce": "bayes_ce {:.4f}",
          "layers": "{} layers", "wall_s": "{:.0f} s of training"}


@cli.one_line_errors
def main(argv):
  t0 = cli.start(argv, workdir=_WORKDIR.value)
  with cli.usage_errors():
    if _PRINT_CONFIG.value:
      return cli.print_config(pretrain.Job.of(_PRESET.value, **_CONFIG.value()))
    cli.make_dir(_WORKDIR.value)
    _INIT_DISTRIBUTED()  # before anything starts a backend (Job.of may)
    job = pretrain.Job.of(_PRESET.value, **_CONFIG.value())
    sharding.check_batch(job.pretrain.batch_size, sharding.data_mesh())
    models_K = job.make_model()
    workdir_lib.prepare(_WORKDIR.value, job.pretrain, models_K)
  cfg = job.pretrain
  params = jax.eval_shape(lambda: transformer.init_params(
      jax.random.PRNGKey(0), cfg.model))
  logging.info("process %d of %d; devices: %s; %d params; %d steps",
               jax.process_index(), jax.process_count(), jax.devices(),
               transformer.num_params(params), cfg.total_steps)
  def after_step(step):
    if _CRASH_AT.value is not None and step >= _CRASH_AT.value:
      os.kill(os.getpid(), signal.Signals[_CRASH_SIGNAL.value])
  final = pretrain.run_trials(_WORKDIR.value, cfg, models_K,
                              log=logging.info, after_step=after_step)
  # Each trial's last evaluation, the same whether just made or read back.
  print("\n".join(f"trial {k}: " + (", ".join(
      f.format(m[n]) for n, f in _SHOWN.items() if n in m) or "no evaluation")
                  for k, m in enumerate(final)))
  cli.done(t0, workdir=_WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
