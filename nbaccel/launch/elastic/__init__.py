"""The elastic backend: ranks on several machines, started by torch's elastic agent (c10d rendezvous)."""

from nbaccel.launch.elastic.launcher import LAUNCHER, ElasticLauncher

__all__ = ["LAUNCHER", "ElasticLauncher"]
