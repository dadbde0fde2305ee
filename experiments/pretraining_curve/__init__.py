"""The pretraining curve's binary over :mod:`hmmprompt.pretraining_curve`."""
