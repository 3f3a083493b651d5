"""The Ray backend: ranks as Ray actors in one placement group, for a launch or a pool."""

from nbaccel.launch.ray.launcher import ACTOR_START_TIMEOUT, LAUNCHER, RayLauncher

__all__ = ["ACTOR_START_TIMEOUT", "LAUNCHER", "RayLauncher"]
