"""Where the posterior lives (docs/probes.md; ``python -m
experiments.probes``): affine probes (:mod:`hmmprompt.probes`) of every
layer's residual stream against the exact posterior, in three studies:
Mess3's beliefs in causal transformers (Shai et al. 2024), the posterior
``P[H_0 | x]`` the paper's labels read at the masked LM's ``MASK`` (the
adaptation comparison's draws and transformers), and GINC's concept and
state posteriors (the ICL study's transformers); each with three controls:
a randomly initialised transformer, shuffled targets, and the output
probabilities (what a head reads). Figure 3's shape: the setup
(:mod:`~hmmprompt.probing.setup`), the sweep
(:mod:`~hmmprompt.probing.sweep`), the report
(:mod:`~hmmprompt.probing.report`)."""

from hmmprompt.probing.setup import (
    LAYOUT, PRESETS, STUDIES, ProbeSetup, check_inputs, get_setup)
from hmmprompt.probing.sweep import (
    CONTROLS, ProbeLine, check_workdir, lines_path, plan, prepare,
    read_probe_lines, run_probes, score_group)
from hmmprompt.probing.report import (adaptation_accuracy, markdown,
                                      write_report, write_simplex)
