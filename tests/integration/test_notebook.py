"""The Colab notebook runs end to end at the tiny preset (so it cannot rot),
on 8 host devices as a TPU v2-8 / v3-8 Colab runtime has them (its
data-parallel pretraining splits each batch over the 8)."""

import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "experiments", "notebooks",
                        "figure3_colab.ipynb")


def test_colab_notebook_executes_at_tiny_preset_on_8_devices(tmp_path,
                                                            monkeypatch):
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  monkeypatch.setenv("XLA_FLAGS", " ".join(
      flags + ["--xla_force_host_platform_device_count=8"]))
  monkeypatch.setenv("HMMPROMPT_PRESET", "tiny")
  monkeypatch.setenv("HMMPROMPT_WORKDIR", str(tmp_path))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep +
                     os.environ.get("PYTHONPATH", ""))
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": ROOT}}).execute()
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                 for o in c.get("outputs", []))
  assert "backend: cpu" in text and "preset: tiny" in text
  assert "CpuDevice(id=7)" in text and "CpuDevice(id=8)" not in text
  assert "rows sum to 1: True" in text
  assert "pretrained" in text and "gap" in text
  for name in ("transformer", "exact"):
    for method in ("head", "prompt"):
      assert f"{name:11s} {method:6s} test accuracy" in text
  with open(tmp_path / "head_vs_prompt.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  # The pretraining it ran resumes instead of starting over.
  assert os.listdir(tmp_path / "pretrain-tiny-h12" / "checkpoints")
