r"""The tuning noise floor of Figure 3's arms (docs/noise_floor.md).

  python -m experiments.noise_floor --workdir=DIR [--preset=cpu_paper] \
      --sizes=4,12,30 --trials=5 --replicates=5 --backbone=exact,transformer \
      [--committed=docs/results/figure3-cpu-paper]

DIR: a Figure 3 workdir (its transformers reused), measured with its run's
setup, --config.* over it (another setup is refused, naming DIR's flags).
Writes DIR/replicates.jsonl (every tuning), noise_floor.md / .json; resumes.
"""

import json
import os
import re
import shlex

from absl import app
from absl import flags

from experiments import cli
from hmmprompt import files as files_lib
from hmmprompt import identity as identity_lib
from hmmprompt.figure3 import configs
from hmmprompt.figure3 import noise
from hmmprompt.figure3 import reporting
from hmmprompt.figure3 import schema
from hmmprompt.figure3 import sweep

_PRESET = flags.DEFINE_enum(
    "preset", None, list(configs.PRESETS), "the Figure 3 preset whose arms "
    "are measured (default: the workdir's, with --config flags for the "
    "fields its sweep.json differs in; cpu_paper in a new workdir)")
_CONFIG = cli.define_config(configs.PRESETS["cpu"]())
_WORKDIR = flags.DEFINE_string("workdir", None, "a Figure 3 workdir; resumes")
_BACKBONE = flags.DEFINE_list("backbone", ["exact"], "exact and/or transformer")
_SIZES = flags.DEFINE_list("sizes", ["4", "12", "30"], "left-panel |H|")
_TRIALS = flags.DEFINE_integer("trials", 5, "the first draws of each size")
_REPLICATES = flags.DEFINE_integer("replicates", 5, "tuning seeds per cell")
_REL = flags.DEFINE_float("rel", 1e-6, "the backbone's relative perturbation "
                          "(0: none)")
_ARMS = flags.DEFINE_list("arms", list(noise.ARMS), "the arms (Setup.arms "
                          "specs, e.g. head,prompt-5,lora-1)")
_COMMITTED = flags.DEFINE_string(
    "committed", None, "a results directory of the same setup to set DIR's "
    "lines beside (reproduction across machines)")
flags.adopt_module_key_flags(cli)


def workdir_setup(workdir: str) -> tuple[str, dict[str, str]]:
  """``(preset, {config path: value})`` of DIR/sweep.json's run: the
  preset fewest fields apart, and those; ``cpu_paper`` where no stamp."""
  if not os.path.exists(path := os.path.join(workdir, sweep.STAMP)):
    return "cpu_paper", {}
  def flat(d, prefix=""):  # {"a.b": leaf} as JSON reads it back
    return {k: v for key, x in json.loads(json.dumps(d)).items()
            for k, v in (flat(x, f"{prefix}{key}.") if isinstance(x, dict)
                         else {prefix + key: x}).items()}
  # An older stamp lacks the fields added since: their class defaults,
  # the same under every preset.
  added = flat(identity_lib.added_defaults(configs.get_setup("tiny")))
  with open(path) as f:
    had = {**added, **flat(json.load(f))}
  apart = {}
  for name, preset in configs.PRESETS.items():
    want = {**added, **flat(preset().identity())}
    apart[name] = {k: ",".join(map(str, v)) if isinstance(v, list) else str(v)
                   for k, v in had.items() if want.get(k) != v}
  best = min(apart, key=lambda name: len(apart[name]))
  return best, apart[best]


def page(workdir: str, title: str, committed: str | None = None) -> str:
  """The page of ``DIR/replicates.jsonl``: spreads per size and arm, each
  arm's floor (also to ``DIR/noise_floor.json``), Adam beside its optimum
  where DIR holds ``head_optimum`` lines, DIR's beside ``committed``'s."""
  summary = noise.summarize(files_lib.read_lines(noise.path(workdir),
                                                 noise.ReplicateLine))
  floor = noise.arm_floor(summary)
  noise.write_floor(os.path.join(workdir, noise.FLOOR), floor)
  lines = schema.read_results(workdir)
  section, points = reporting.table_section, reporting.points
  parts = [f"# {title}\n", section(
      "Spread per size and arm (test accuracy, points)",
      ("backbone", "size", "arm", "draws", "seeds", "between draws (sd)",
       "within a draw, tuning seeds (sd)", "largest seed range",
       "largest change at a 1e-6 perturbation"),
      [(b, size, m, s["draws"], s["seeds"], *(points(s[k]) for k in (
          "draw_sd", "seed_sd", "seed_range", "perturbed")))
       for (b, size, m), s in summary.items()]), reporting.floor_note(floor),
           section("Adam against the optimum (head, test accuracy, points)", (
               "backbone", "panel", "size", "lines", "Adam > 1 point below",
               "mean shortfall", "largest shortfall", "prompt - Adam head",
               "prompt - optimum head"), noise.adam_vs_optimum(lines))]
  if committed:
    parts.append(section(f"Beside the lines of {committed}", (
        "backbone", "arm", "size", "lines", "differ", "largest accuracy change",
        "largest gap change (nats)"), noise.reproduction(
            lines, schema.read_results(committed))))
  return "\n".join(p for p in parts if p)


@cli.one_line_errors
def main(argv):
  t0, workdir = cli.start(argv, workdir=_WORKDIR.value), _WORKDIR.value
  with cli.usage_errors():
    preset, overrides = workdir_setup(workdir)
    own = shlex.join([f"--preset={preset}"] + [
        f"--config.{k}={v}" for k, v in sorted(overrides.items())])
    if _PRESET.value:
      preset, overrides = _PRESET.value, {}
    setup = configs.get_setup(preset, {**overrides, **_CONFIG.value()})
    configs.check_run(setup, _BACKBONE.value)
    cli.make_dir(workdir)
    try:
      sweep.check_workdir(workdir, setup)
    except ValueError as e:  # the fix: DIR's own setup, not a new DIR
      raise ValueError(re.split(r"[;:] use a new --workdir", str(e))[0] + ": "
                       f"drop --preset and --config.* to measure it with its "
                       f"own ({own})") from None
    sizes = [int(s) for s in _SIZES.value]
    for name in _BACKBONE.value:
      noise.run(setup, workdir, name, sizes, _TRIALS.value,
                _REPLICATES.value, _REL.value, arms=_ARMS.value)
  title = (f"The tuning noise floor: preset {preset}, |H| = "
           f"{', '.join(map(str, sizes))}, {_TRIALS.value} draws, "
           f"{_REPLICATES.value} tuning seeds")
  path = os.path.join(workdir, "noise_floor.md")
  files_lib.atomic_write_text(path, page(workdir, title, _COMMITTED.value))
  cli.done(t0, report=path)


if __name__ == "__main__":
  app.run(main)
