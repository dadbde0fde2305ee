"""In-context learning on GINC (docs/icl.md; ``python -m experiments.icl``):
GINC's prompts scored by the exact mixture of its concepts (the Bayes predictor:
exact zeros, or smoothed per concept) and by causal transformers pretrained on
its text, one per seed."""

from hmmprompt.icl.setup import (
    CONCEPTS, LAYOUT, PRESETS, REFERENCE, RELEASED, IclSetup, check_inputs,
    exact_model, get_setup, load_concepts, memory_of, prompt_len, smoothing)
from hmmprompt.icl.sweep import (
    Backbone, Group, IclLine, cell_prompts, check_workdir, kl_to, lines_path,
    next_symbol, plan, prepare, pretrain_dir, read_icl_lines, run_icl,
    score_group)
from hmmprompt.icl.report import markdown, summarize, write_plot, write_report
