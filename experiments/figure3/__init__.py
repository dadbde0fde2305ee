"""The Figure 3 binary, ``python -m experiments.figure3`` (``__main__``);
the library it calls is :mod:`hmmprompt.figure3`."""
