"""The Figure 3 binary (``__main__``) over :mod:`hmmprompt.figure3`."""
