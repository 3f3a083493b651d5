"""Reading a SLURM allocation: how many machines, which one this is, and where machine 0 is.

``srun --ntasks-per-node=1 nbaccel launch train.py`` runs one launcher per node; each one
finds its place in the job from SLURM's variables, so no ``--machine_rank`` is needed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from nbaccel.errors import ConfigError

__all__ = ["SlurmJob", "first_host", "read_slurm"]

_BASE_PORT = 15000  # a port derived from the job id, so every node agrees without being told


@dataclass(frozen=True)
class SlurmJob:
    """This launcher's place in a SLURM job.

    Attributes:
        job_id: ``SLURM_JOB_ID``.
        num_nodes: machines in the job step.
        node_rank: this machine's index among them.
        main_host: the first host of the node list (machine 0).
        port: a rendezvous port every node derives from the job id alone.
    """

    job_id: str
    num_nodes: int
    node_rank: int
    main_host: str
    port: int

    @property
    def note(self) -> str:
        """One line saying what was picked up."""
        return (f"nbaccel: SLURM job {self.job_id}: this is machine {self.node_rank} of {self.num_nodes}"
                + (f"; machine 0 is {self.main_host}" if self.num_nodes > 1 else ""))


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list such as ``"gpu[03-05,9],login1"`` (here ``"gpu03"``).

    Raises:
        ConfigError: the list is empty or its brackets do not match.

    Example:
        >>> first_host("node[01-04],cpu7")
        'node01'
    """
    text = nodelist.strip()
    depth, end = 0, len(text)
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    first = text[:end]
    if not first or first.count("[") != first.count("]"):
        raise ConfigError(f"SLURM node list {nodelist!r} is not a host list like 'node[01-04]'. Fix: run "
                          "under srun/sbatch, or pass --main_process_ip.", key="SLURM_JOB_NODELIST",
                          value=nodelist, valid="a SLURM host list")
    return re.sub(r"\[([^\]\[]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    match = re.match(r"\d+", raw)  # SLURM_TASKS_PER_NODE-style values like "4(x2)"
    if match is None:
        raise ConfigError(f"SLURM variable {name} must be a number (got {raw!r})", key=name, value=raw,
                          valid="a number")
    return int(match.group())


def read_slurm(env: Mapping[str, str] | None = None) -> SlurmJob | None:
    """The SLURM job this process runs in, or ``None`` outside SLURM.

    Raises:
        ConfigError: several launchers were started per node, or a variable is malformed.
    """
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    nodes = _int(env, "SLURM_STEP_NUM_NODES") or _int(env, "SLURM_NNODES") or _int(env, "SLURM_JOB_NUM_NODES") or 1
    tasks = _int(env, "SLURM_STEP_NUM_TASKS")
    if tasks is not None and tasks > nodes:
        raise ConfigError(
            f"this SLURM step runs {tasks} tasks on {nodes} node(s), but `nbaccel launch` starts the workers of a "
            "machine itself, so it must run once per node. Fix: `srun --ntasks-per-node=1 nbaccel launch ...` "
            "and choose the workers per node with --num_processes.", key="SLURM_STEP_NUM_TASKS", value=tasks,
            valid=f"{nodes} (one per node)")
    node_rank = _int(env, "SLURM_NODEID")
    if node_rank is None:
        node_rank = _int(env, "SLURM_PROCID") or 0
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    host = first_host(nodelist) if nodes > 1 else "127.0.0.1"
    digits = re.sub(r"\D", "", job_id)[-4:] or "0"
    return SlurmJob(job_id=job_id, num_nodes=nodes, node_rank=node_rank, main_host=host,
                    port=_BASE_PORT + int(digits))
