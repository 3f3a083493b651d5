"""Training: the ``Accelerator`` and its parts (preparation, precision, loaders, checkpoints, sharding).

The public names are exported from the top level (``from nbaccel import Accelerator``), as in
Accelerate; import from here only to reach a part directly.
"""
