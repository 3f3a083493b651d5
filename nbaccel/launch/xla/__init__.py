"""The XLA backend: TPU cores as replicas started by ``torch_xla.launch`` in a host process."""

from nbaccel.launch.xla.launcher import (
    HOST_RANK,
    LAUNCHER,
    XlaLauncher,
    current_replica,
)
from nbaccel.launch.xla.topology import xla_replica_count

__all__ = ["HOST_RANK", "LAUNCHER", "XlaLauncher", "current_replica", "xla_replica_count"]
