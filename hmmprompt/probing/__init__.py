"""Where the posterior lives (docs/probes.md; ``python -m experiments.probes``):
affine probes (:mod:`hmmprompt.probes`) of every layer's residual stream against
the exact posterior: Mess3's beliefs in causal transformers (Shai et al. 2024),
the posterior ``P[H_0 | x]`` the paper's labels read at the MLM's ``MASK`` (the
adaptation comparison's draws and transformers), GINC's concept and state
posteriors (the ICL study's); controls: a randomly initialised transformer,
shuffled targets, the output probabilities (what a head reads)."""

from hmmprompt.probing.setup import (
    LAYOUT, PRESETS, STUDIES, ProbeSetup, check_inputs, get_setup)
from hmmprompt.probing.sweep import (
    CONTROLS, ProbeLine, check_workdir, lines_path, plan, prepare,
    read_probe_lines, run_probes, score_group)
from hmmprompt.probing.report import (adaptation_accuracy, markdown,
                                      write_report, write_simplex)
