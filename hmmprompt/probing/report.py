"""Where the posterior lives, its report: DIR/probes.md and
DIR/mess3_simplex.png (:func:`write_simplex`, drawn by the sweep)."""

import os

import numpy as np

from hmmprompt import files as files_lib
from hmmprompt.figure3 import reporting
from hmmprompt.probing.setup import ADAPTATION_RESULTS, get_setup
from hmmprompt.probing.sweep import CONTROLS, ProbeLine, read_probe_lines

ARMS = {"head": "head_{}", "prompt": "prompt_{}", "LoRA": "lora_{}_r4"}
"""The adaptation arms set beside the probes (prompt: 20 vectors)."""


def _ms(values, scale: float = 1.0, fmt: str = ".3f") -> str:
  v = scale * np.asarray(values, np.float64)
  return f"{v.mean():{fmt}}" + (f" ± {v.std():{fmt}}" if len(v) > 1 else "")


def best(line: ProbeLine, field: str = "r2") -> tuple[int, float]:
  """``(input index, field's value)`` at the block (not the embedding or
  output) of best held-out R², within the trial's own depth."""
  i = 1 + int(np.argmax(line.r2[1:line.layers + 1]))
  return i, (getattr(line, field) or [np.nan] * (i + 1))[i]


def _by(lines, **where) -> list[ProbeLine]:
  return [r for r in lines if all(getattr(r, k) == v for k, v in where.items())]


def _mess3(lines: list[ProbeLine]) -> list[str]:
  got = {c: _by(lines, study="mess3", control=c) for c in CONTROLS}
  if not got["trained"]:
    return []
  names = got["trained"][0].inputs
  col = lambda c, f, i: _ms([getattr(r, f)[i] for r in got[c]]) if got[c] else ""
  cols = [("trained", "r2"), ("trained", "tv"), ("trained", "kl"),
          ("random", "r2"), ("random", "tv"), ("shuffled", "r2")]
  rows = [[n] + [col(c, f, i) for c, f in cols] for i, n in enumerate(names)]
  gaps = ", ".join(f"{r.ce_gap:.4f}" for r in got["trained"])
  return ["## Mess3", "", f"Causal transformers on Mess3 (x = 0.05, alpha = "
          f"0.85), {len(got['trained'])} seeds (held-out next-symbol CE gaps "
          f"to the Bayes CE: {gaps} nats); the belief P(S_t | x_<t) probed at "
          f"every position, {got['trained'][0].rows} held-out rows. Mean ± sd "
          "over seeds.", ""] + files_lib.markdown_table(
              ["input", "R²", "TV", "KL (nats)", "R², random init",
               "TV, random init", "R², shuffled"], rows) + [
                   "", "![Mess3's belief simplex](mess3_simplex.png)", ""]


def adaptation_accuracy(results_path: str) -> dict:
  """``{(model tag, trial, hmm fingerprint): {arm: accuracy}}`` from an
  adaptation ``results.jsonl``: :data:`ARMS` on the transformer, ``exact head``
  and ``exact prompt`` on the exact backbone, the pretraining gap ``gap``."""
  out: dict = {}
  for d in files_lib.read_jsonl(results_path):
    mem = f"-m{d['memory_size']}" if d["hmm"] == "memory" else ""
    head = "attention" if d["hmm"] == "memory" else "linear"
    cell = out.setdefault((f"{d['hmm']}-h{d['num_states']}{mem}", d["trial"],
                           d["hmm_fingerprint"]), {})
    for arm, name in ARMS.items():
      if d["method"] != name.format(head) or d["features"] != "raw":
        continue
      if d["backbone"] == "transformer":
        cell[arm], cell["gap"] = d["test_accuracy"], d["pretrain_ce_gap"]
      elif arm != "LoRA":
        cell[f"exact {arm}"] = d["test_accuracy"]
  return out


def _corr(a, b) -> str:
  if len(a) < 3 or np.std(a) == 0 or np.std(b) == 0:
    return "n/a"
  return f"{np.corrcoef(a, b)[0, 1]:+.2f}"


def _tasks(lines: list[ProbeLine], results_path: str) -> list[str]:
  if not (trained := _by(lines, study="tasks", control="trained")):
    return []
  arms = adaptation_accuracy(results_path)  # {} if the file is missing
  ctrl = {(r.model, r.trial, r.control): r for r in _by(lines, study="tasks")}
  rows, labels = [], []
  pairs: dict[str, list] = {k: [] for k in "r2 acc lora prompt gap tag".split()}
  last = lambda r, f: (getattr(r, f) or [np.nan])[-1]  # the output's
  for tag in sorted({r.model for r in trained}, key=lambda t: (
      t.startswith("memory"), int(t.split("-h")[1].split("-")[0]))):
    mine = sorted(_by(trained, model=tag), key=lambda r: r.trial)
    acc = [arms.get((tag, r.trial, r.hmm_fingerprint), {}) for r in mine]
    arm = lambda a: (_ms([x[a] for x in acc], 100, ".1f")
                     if all(a in x for x in acc) else "")
    other = lambda c: _ms([best(ctrl[(tag, r.trial, c)])[1] for r in mine
                           if (tag, r.trial, c) in ctrl])
    rows.append([tag, len(mine), _ms([r.r2[-1] for r in mine]),
                 _ms([best(r)[1] for r in mine]),
                 ", ".join(str(best(r)[0]) for r in mine), other("random"),
                 other("shuffled")])
    labels.append([tag, _ms([last(r, "label_r2") for r in mine]),
                   _ms([best(r, "label_r2")[1] for r in mine]),
                   _ms([last(r, "label_acc") for r in mine], 100, ".1f"),
                   _ms([best(r, "label_acc")[1] for r in mine], 100, ".1f"),
                   arm("head"), arm("prompt"), arm("LoRA"), arm("exact head"),
                   arm("exact prompt")])
    for r, x in zip(mine, acc):
      if all(a in x for a in ARMS):
        for k, v in (("r2", best(r)[1] - r.r2[-1]),
                     ("acc", best(r, "label_acc")[1] - last(r, "label_acc")),
                     ("lora", x["LoRA"] - x["head"]),
                     ("prompt", x["prompt"] - x["head"]),
                     ("gap", abs(x["gap"] - r.ce_gap)), ("tag", tag)):
          pairs[k].append(v)
  out = ["## The paper's tasks", "",
         "At the `MASK`, the posterior the label reads (`P[H_0 | x]`; memory "
         "HMMs: `P[M | x]`), probed on each draw's task: fit on its train "
         "split, ridge on val, scored on test. R² of the output "
         "probabilities' probe (what a head reads) and of the best block's "
         "(its index per draw; 0 is the embedding), and the controls' best "
         "block; mean ± sd over draws.", ""]
  out += files_lib.markdown_table(
      ["model", "draws", "R² output", "R² best block", "best block",
       "R² random init", "R² shuffled"], rows)
  out += ["", "The label from the probes: the R² of the label's scores "
          "`mu @ p` (the probe's prediction unprojected) and the label "
          "accuracy (%) of `argmax mu @ q` (`q` projected onto the simplex), "
          "from the output and the best block, beside the adaptation arms' "
          "test accuracy (%) on the same draws (prompt: 20 vectors; LoRA: "
          "rank 4).", ""] + files_lib.markdown_table(
              ["model", "label R² output", "label R² best block",
               "probe acc output", "probe acc best block", "head", "prompt",
               "LoRA", "exact head", "exact prompt"], labels)
  if pairs["gap"]:
    tags = np.asarray(pairs["tag"])
    within = lambda v: np.asarray(v) - [np.mean(np.asarray(v)[tags == t])
                                        for t in tags]  # each size's mean off
    corr = lambda a, b: (f"{_corr(pairs[a], pairs[b])} across draws, "
                         f"{_corr(within(pairs[a]), within(pairs[b]))} "
                         f"within sizes")
    out += ["", f"Draw by draw ({len(tags)} draws joined to {results_path} "
            f"by HMM fingerprint; their pretraining gaps agree within "
            f"{max(pairs['gap']):.1e} nats): LoRA's gain over the head (mean "
            f"{100 * np.mean(pairs['lora']):+.1f} points) against the "
            f"posterior the output loses (best block's R² minus the "
            f"output's, mean {np.mean(pairs['r2']):+.3f}): r = "
            f"{corr('r2', 'lora')}; against the probes' label gain (mean "
            f"{100 * np.mean(pairs['acc']):+.1f} points): {corr('acc', 'lora')}"
            f". The prompt's gain (mean {100 * np.mean(pairs['prompt']):+.1f}"
            f") against the same: {corr('r2', 'prompt')}; "
            f"{corr('acc', 'prompt')}."]
  else:
    out += ["", f"No draw matched {results_path} (another setup's draws): "
            "the arms' columns are blank."]
  return out + [""]


def _ginc(lines: list[ProbeLine]) -> list[str]:
  if not (trained := _by(lines, study="ginc", control="trained")):
    return []
  ctrl = {(r.trial, r.target, r.where, r.control): r for r in lines
          if r.study == "ginc"}
  order = lambda w: -1 if w == "documents" else int(w[2:])
  rows = []
  for target in ("concept", "state"):
    for where in sorted({r.where for r in trained}, key=order):
      if not (mine := _by(trained, target=target, where=where)):
        continue
      other = lambda c: [best(ctrl[(r.trial, target, where, c)])[1]
                         for r in mine if (r.trial, target, where, c) in ctrl]
      rows.append([target, where, mine[0].rows, _ms([r.r2[-1] for r in mine]),
                   _ms([best(r)[1] for r in mine]),
                   _ms([best(r, "tv")[1] for r in mine]),
                   f"{mine[0].peak_exact:.3f}",
                   _ms([best(r, "peak")[1] for r in mine]),
                   _ms(other("random")), _ms(other("shuffled"))])
  gaps = ", ".join(f"{r.ce_gap:.3f}" for r in _by(
      trained, target="concept", where="documents"))
  return ["## GINC", "", "The ICL study's causal transformers (CE gaps "
          f"{gaps} nats): the concept posterior and the state posterior "
          "`P[H_t | x_<t]` of the mixture, probed on documents (every few "
          "positions) and at the label position of `ID_sample` prompts with "
          "k examples (the reference `exact concept:1e-06`'s posterior). "
          "Peak: the mean largest probability, exact and of the best "
          "block's projected probe. Mean ± sd over seeds.", ""
          ] + files_lib.markdown_table(
              ["target", "where", "held-out rows", "R² output",
               "R² best block", "TV best block", "peak exact",
               "peak probe", "R² random init", "R² shuffled"], rows) + [""]


def markdown(lines: list[ProbeLine], results_path: str, smoke: str = "") -> str:
  """DIR/probes.md: a section per study present."""
  out = ["# Where the posterior lives: linear probes of the residual stream",
         ""] + ([smoke, ""] if smoke else []) + [
             "Affine probes fitted by ridge regression (float64, ridge chosen "
             "on a validation split) from each input (`embed`, `block i`, "
             "`output`: the output probabilities) to the exact posterior; "
             "held-out R² (1 - residual / total sum of squares, pooled over "
             "the posterior's coordinates), total variation and KL to the "
             "prediction projected onto the simplex. Controls: the same "
             "probe of a randomly initialised transformer of the same shape, "
             "and of targets shuffled across sequences.", ""]
  return "\n".join(out + _mess3(lines) + _tasks(lines, results_path)
                   + _ginc(lines))


def write_report(workdir: str, results_path: str = ADAPTATION_RESULTS) -> str:
  """Writes and returns DIR/probes.md (``results_path``: adaptation results)."""
  lines = read_probe_lines(workdir)
  smoke = reporting.smoke(
      get_setup("tiny").fingerprint() in {r.setup for r in lines},
      "the `tiny` preset's (a few steps of pretraining, tiny HMMs, few "
      "sequences)", "`--preset=cpu` or docs/results/probes")
  text = markdown(lines, results_path, smoke)
  files_lib.atomic_write_text(os.path.join(workdir, "probes.md"), text)
  return text


def write_simplex(workdir: str, kept, r2_IxK) -> None:
  """DIR/mess3_simplex.png: trial 0's held-out beliefs, exact and probed at
  its best block, in the simplex, coloured by the exact belief."""
  y, q_I = kept
  i = 1 + int(np.argmax(r2_IxK[1:-1, 0]))
  fig, axes = files_lib.pyplot().subplots(1, 2, figsize=(9, 4.4))
  xy = lambda p: (p[:, 1] + 0.5 * p[:, 2], np.sqrt(3) / 2 * p[:, 2])
  for ax, p, title in ((axes[0], y[0], "exact belief"),
                       (axes[1], q_I[i, 0], f"probe of block {i} "
                        f"(held-out R² {r2_IxK[i, 0]:.3f})")):
    ax.scatter(*xy(p), s=1.5, c=np.clip(y[0], 0, 1), alpha=0.6, linewidths=0)
    ax.plot([0, 1, 0.5, 0], [0, 0, np.sqrt(3) / 2, 0], "k-", lw=0.6)
    ax.set_title(title, fontsize=10)
    ax.set_aspect("equal")
    ax.axis("off")
  fig.suptitle("Mess3 (x = 0.05, alpha = 0.85): the belief simplex")
  fig.tight_layout()
  files_lib.atomic_write_png(os.path.join(workdir, "mess3_simplex.png"), fig)
