"""``experiments/check_cudnn_bias.py``, the first thing
``accelerator_session.sh protocol`` runs on a device, here on a CPU,
where XLA's attention stands in for cuDNN: it runs at the depth the script
asks for (``--num_layers=1``), and ends 1 naming why when the bias
gradient is off (here a bound of 0: the two paths' bf16 gradients never
agree to the bit)."""

import re

import binaries  # tests/integration/binaries.py


def test_the_bias_check_runs_one_layer_and_fails_by_name():
  ok, off = binaries.usage_errors("experiments.check_cudnn_bias", [
      ["--tiny", "--num_layers=1"],
      ["--tiny", "--num_layers=1", "--max_rel_diff=0"]])
  assert ok["returncode"] == 0, ok["stderr"][-3000:]
  assert "; 1 layers, d 32," in ok["stdout"]
  per_layer = re.search(r"per layer: (.*)", ok["stdout"]).group(1).split()
  # bf16 against the manual path: within the script's default bound.
  assert len(per_layer) == 1 and 0 < float(per_layer[0]) < 0.1, per_layer
  assert ok["stdout"].rstrip().endswith(
      "OK: the bias gradient is nonzero and matches the manual path")
  assert off["returncode"] == 1, off["stderr"][-3000:]
  assert re.search(r"^FAILED: the bias gradient is \S+ from manual's "
                   r"\(> --max_rel_diff=0\.0\)$", off["stdout"], re.M)
