r"""One-off studies (docs/performance.md), one per ``--study``:

  taskset -c 0 env XLA_FLAGS=--xla_cpu_multi_thread_eigen=false \
      python -m experiments.bench.studies --study=block_parts
  python -m experiments.bench.studies --study=compiles [--pretrain_steps=100]
  python -m experiments.bench.studies --study=bytes --preset=paper \
      --workdir=DIR [--backbone=exact] [--panel=both]
  python -m experiments.bench.studies --study=tuning [--lanes=4] [--rounds=3]

block_parts: forward vs gradient time of a ``cpu_capped`` block's parts;
compiles: the transformer sweep's XLA compiles, backbones cached per config vs
rebuilt per model; bytes: a sweep's peak memory and time, bounded vs
unbounded; tuning: prompt tuning, the MASK's row alone in the last block vs
the full forward. docs/performance.md gives each one's section and results.
"""

import dataclasses
import functools
import json
import os
import re
import sys
import tempfile
import time

from absl import app
from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp

from experiments.bench import harness
from hmmprompt import figure3
from hmmprompt import generative
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import protocol
from hmmprompt import tasks
from hmmprompt import tuning
from hmmprompt.backbones import transformer

_STUDY = flags.DEFINE_enum("study", None, ["block_parts", "compiles", "bytes",
                                           "tuning"], "which", required=True)
_PRESET = flags.DEFINE_string("preset", None, "figure3 preset (default: "
                              "compiles cpu, bytes paper, tuning cpu_paper)")
_STEPS = flags.DEFINE_integer("pretrain_steps", 100, "compiles: per model")
_BACKBONE = flags.DEFINE_string("backbone", "exact", "bytes: or transformer")
_PANEL = flags.DEFINE_string("panel", "both", "bytes: left | right | both")
_WORKDIR = flags.DEFINE_string("workdir", None, "bytes (required): the sweeps'")
_LANES = flags.DEFINE_integer("lanes", 4, "tuning: seeds in one program")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "tuning: timed runs of each arm")
_CHILD = flags.DEFINE_enum("child", None, ["cached", "uncached"], "internal: "
                           "compiles' sweep in --workdir; print its counts")


def parts(b: int = 32, t: int = 80) -> dict:
  """``{name: (f, args)}``: the block's parts and the block."""
  cfg = pretrain_lib.configure("cpu_capped", protocol.VOCAB).model
  d, a = cfg.d_model, cfg.num_heads
  key = jax.random.PRNGKey(0)
  x_BxTxD = jax.random.normal(key, (b, t, d))
  q_BxAxTxE = jax.random.normal(key, (b, a, t, d // a))
  bias_AxTxT = jax.random.normal(key, (a, t, t))
  def attention(q, k, v, bias):
    logits = jnp.matmul(q, jnp.swapaxes(k, -1, -2)) / 4.0 + bias
    return jnp.matmul(jax.nn.softmax(logits, -1), v)

  def module(m, x):
    return (lambda p, x: m.apply(p, x)), (m.init(key, x), x)
  return {
      "layernorm": module(nn.LayerNorm(), x_BxTxD),
      "dense qkv": module(transformer.TokenDense(3 * d), x_BxTxD),
      "attention (qk, softmax, av)": (attention, (
          q_BxAxTxE, q_BxAxTxE + 1, 2 * q_BxAxTxE, bias_AxTxT)),
      "softmax": (lambda z: jax.nn.softmax(z, -1),
                  (jax.random.normal(key, (b, a, t, t)),)),
      "gelu": (nn.gelu, (jax.random.normal(key, (b, t, cfg.d_ff)),)),
      "block": module(transformer.Block(cfg), x_BxTxD)}


def block_parts():
  print("| part | forward (ms) | grad (ms) | grad / forward |\n|---|---|---|---|")
  for name, (f, args) in parts().items():  # ms per call, mean of 40
    loss = lambda *a, f=f: jnp.sum(jnp.tanh(f(*a)))
    fwd, grad = (1e3 * harness.seconds_per_call(lambda g=g: g(*args), steps=40)
                 for g in (jax.jit(loss), jax.jit(jax.grad(
                     loss, argnums=tuple(range(len(args)))))))
    print(f"| {name} | {fwd:.2f} | {grad:.2f} | {grad / fwd:.1f} |", flush=True)


def compiles():
  preset, mode = _PRESET.value or "cpu", _CHILD.value
  if mode:  # one sweep (uncached: new closures for every model); its counts
    stats = {"compiles": 0, "compile_s": 0.0}
    def listener(event, duration, **_):
      if event == "/jax/core/compile/backend_compile_duration":
        stats["compiles"] += 1
        stats["compile_s"] += duration
    jax.monitoring.register_event_duration_secs_listener(listener)
    if mode == "uncached":
      transformer.make_backbone = transformer.build_backbone
    setup = figure3.get_setup(preset,
                              overrides={"pretrain.steps": _STEPS.value})
    t0 = time.perf_counter()
    figure3.run_sweep(setup, _WORKDIR.value, "both", "transformer")
    stats["wall_s"] = time.perf_counter() - t0
    stats["lines"] = len(figure3.read_results(_WORKDIR.value))
    return print(json.dumps(stats))
  out = {}
  for mode in ("uncached", "cached"):
    with tempfile.TemporaryDirectory() as d:
      proc = harness.child(
          [sys.executable, "-m", "experiments.bench.studies",
           "--study=compiles", f"--child={mode}", f"--workdir={d}",
           f"--preset={preset}", f"--pretrain_steps={_STEPS.value}"],
          f"the {mode} sweep")
      out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
      print(f"{mode:9s} {out[mode]}", flush=True)
  u, c = out["uncached"], out["cached"]
  print(f"compiles {u['compiles']} -> {c['compiles']}; compile time "
        f"{u['compile_s']:.0f} s -> {c['compile_s']:.0f} s; sweep wall "
        f"{u['wall_s']:.0f} s -> {c['wall_s']:.0f} s "
        f"({u['wall_s'] / c['wall_s']:.2f}x)")


ARMS = {"unbounded": ["--config.lanes_per_vmap=0", "--config.task_budget_mb=0"],
        "bounded": []}
_TIME_FIELDS = {  # field: its line in /usr/bin/time -v's output, its value
    "peak_rss_gb": (r"Maximum resident set size \(kbytes\): (\d+)",
                    lambda s: int(s) / 1e6),
    "user_s": (r"User time \(seconds\): ([\d.]+)", float),
    "sys_s": (r"System time \(seconds\): ([\d.]+)", float),
    "wall_s": (r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)",
               lambda s: sum(float(p) * 60 ** i
                             for i, p in enumerate(reversed(s.split(":")))))}


def run_arm(name: str, workdir: str, preset: str) -> dict:
  """One sweep under ``/usr/bin/time -v``; its measured fields."""
  cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "experiments.figure3",
         f"--preset={preset}", f"--backbone={_BACKBONE.value}",
         f"--panel={_PANEL.value}", f"--workdir={workdir}", *ARMS[name]]
  print("$", " ".join(cmd[2:]), flush=True)
  proc = harness.child(cmd, f"{name}: the sweep")
  out = {}
  for field, (pattern, value) in _TIME_FIELDS.items():
    if (m := re.search(pattern, proc.stderr)) is None:
      raise SystemExit(f"{name}: no {field!r} in /usr/bin/time's output")
    out[field] = value(m.group(1))
  return out


def bytes_():
  if not _WORKDIR.value:
    raise app.UsageError("--study=bytes needs --workdir")
  if not os.path.exists("/usr/bin/time"):
    raise SystemExit("needs /usr/bin/time (GNU time) for peak RSS")
  preset, workdir = _PRESET.value or "paper", os.path.abspath(_WORKDIR.value)
  measured = {name: run_arm(name, os.path.join(workdir, name), preset)
              for name in ARMS}
  a, b = ({r.key(): r for r in figure3.read_results(os.path.join(
      workdir, name))} for name in ("unbounded", "bounded"))
  # The two arms share their setup fingerprint (runtime settings only).
  common = sorted(set(a) & set(b))
  if not common or len(common) != len(a) or len(a) != len(b):
    raise SystemExit(f"the arms' result lines differ in keys: {len(a)} vs "
                     f"{len(b)}, {len(common)} in common")
  acc_diff = [abs(a[k].test_accuracy - b[k].test_accuracy) for k in common]
  loss_diff = [abs(a[k].final_loss - b[k].final_loss) for k in common]
  print(f"\n{preset} / {_BACKBONE.value} / {_PANEL.value}: "
        f"{len(common)} result lines\n| arm | peak RSS | wall | user | sys |"
        "\n|---|---|---|---|---|")
  for name, m in measured.items():
    print(f"| {name} | {m['peak_rss_gb']:.2f} GB | {m['wall_s']:.0f} s | "
          f"{m['user_s']:.0f} s | {m['sys_s']:.0f} s |")
  ub, bd = measured["unbounded"], measured["bounded"]
  print(f"\nbounded / unbounded: peak RSS "
        f"{bd['peak_rss_gb'] / ub['peak_rss_gb']:.2f}x, wall "
        f"{bd['wall_s'] / ub['wall_s']:.2f}x\ntest accuracy equal on "
        f"{acc_diff.count(0.0)} of {len(common)} lines (largest difference "
        f"{max(acc_diff):.4f}); final loss within {max(loss_diff):.2g}")
  print(json.dumps({"arms": measured, "lines": len(common),
                    "accuracy_equal": acc_diff.count(0.0),
                    "max_accuracy_diff": max(acc_diff),
                    "max_loss_diff": max(loss_diff)}))


def prompt_tuning():
  preset, lanes = _PRESET.value or "cpu_paper", _LANES.value
  setup = figure3.get_setup(preset)
  model = generative.as_hmm(generative.random_model(
      jax.random.PRNGKey(0), "vanilla", 30, protocol.VOCAB))
  task = tasks.make_task(jax.random.PRNGKey(1), model, setup.task)
  cfg = dataclasses.replace(setup.tune, method="prompt")
  data = jax.tree.map(lambda x: jnp.stack([x] * lanes),
                      tuning.data_from_task(task, cfg))
  keys = jax.random.split(jax.random.PRNGKey(2), lanes)
  params = transformer.init_params(jax.random.PRNGKey(3), setup.pretrain.model)
  at = transformer.build_backbone(setup.pretrain.model)
  tune = lambda bb: functools.partial(tuning.tune, keys, bb, params, data, cfg)
  spent = harness.interleaved({
      "full forward (baseline)": tune(dataclasses.replace(at, apply_at=None)),
      "MASK row in the last block": tune(at)}, _ROUNDS.value)
  print(f"{preset}: prompt tuning, {lanes} lanes, "
        f"{setup.task.num_train} examples x {cfg.epochs} epochs, "
        f"{jax.default_backend()}")
  for name, s in spent.items():
    print(f"{name:28s} {s / _ROUNDS.value / lanes:6.2f} s per lane")
  base, new = spent.values()
  print(f"ratio: {base / new:.2f}x faster")


# Each: its body, glibc's setting, whether the header starts jax (or not).
STUDIES = {"block_parts": (block_parts, False, True),
           "compiles": (compiles, True, False), "bytes": (bytes_, False, False),
           "tuning": (prompt_tuning, True, True)}


def main(argv):
  body, retain, devices = STUDIES[_STUDY.value]
  harness.start(argv, retain, devices)
  return body()


if __name__ == "__main__":
  app.run(main)
