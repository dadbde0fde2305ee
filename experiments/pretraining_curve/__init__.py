"""The pretraining curve's binary (``python -m experiments.pretraining_curve``)
over its library, :mod:`hmmprompt.pretraining_curve`."""
