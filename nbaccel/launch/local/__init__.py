"""The local backend: ranks as this machine's processes, forked or spawned, watched by the supervisor."""

from nbaccel.launch.local.launcher import LAUNCHER, LocalLauncher, local_environments

__all__ = ["LAUNCHER", "LocalLauncher", "local_environments"]
