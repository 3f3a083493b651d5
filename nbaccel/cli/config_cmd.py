"""`nbaccel config`: write the launch config file, by questions with defaults or for this machine.

It writes the same YAML as the notebook's ``%accel_config`` panel (through
:func:`nbaccel.config.save_config`). Questions are read from stdin line by line, so answers can
be piped in; an empty answer (or the end of input) takes the default shown in brackets.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO, TypeVar, cast, get_args

from nbaccel.distributed_type import DistributedType
from nbaccel.config import LaunchConfig, PlacementStrategy, load_config, save_config
from nbaccel.environment import MixedPrecision, config_file_path
from nbaccel.errors import ConfigError
from nbaccel.hardware import cpu_count, cuda_device_count, tpu_detected

__all__ = ["default_config", "register"]

T = TypeVar("T")
S = TypeVar("S", bound=str)
_MAX_DEFAULT_CPU_PROCESSES = 4  # the same cap as an automatic launch
_ATTEMPTS = 3


def default_config(mixed_precision: MixedPrecision = "no") -> LaunchConfig:
    """A config for this machine: every GPU, else the TPU, else one CPU process per core (at most 4).

    Example:
        >>> default_config().num_machines
        1
    """
    gpus = cuda_device_count()
    if gpus:
        return LaunchConfig(distributed_type=DistributedType.MULTI_GPU if gpus > 1 else DistributedType.NO,
                            num_processes=gpus,
                            mixed_precision=mixed_precision)
    if tpu_detected():
        return LaunchConfig(distributed_type=DistributedType.XLA, mixed_precision=mixed_precision)
    n = max(1, min(cpu_count(), _MAX_DEFAULT_CPU_PROCESSES))
    return LaunchConfig(distributed_type=DistributedType.MULTI_CPU if n > 1 else DistributedType.NO, num_processes=n,
                        use_cpu=True, mixed_precision=mixed_precision)


class _Asker:
    """Asks one question at a time on ``out`` and reads the answer from ``inp``."""

    def __init__(self, inp: TextIO, out: TextIO) -> None:
        self.inp, self.out = inp, out
        self.ended = False

    def ask(self, question: str, default: T, parse: Callable[[str], T], shown: str | None = None) -> T:
        label = shown if shown is not None else ("" if default is None else str(default))
        for attempt in range(_ATTEMPTS):
            self.out.write(f"{question} [{label}]: ")
            self.out.flush()
            line = "" if self.ended else self.inp.readline()
            if not line:
                self.ended = True
                self.out.write("\n")
                if attempt:  # input ended before a wrong answer was corrected
                    break
            elif not self.inp.isatty():  # piped answers: echo them so the transcript reads well
                self.out.write(line if line.endswith("\n") else line + "\n")
            answer = line.strip()
            if not answer:
                return default
            try:
                return parse(answer)
            except ValueError as exc:
                self.out.write(f"  {exc}\n")
        raise ConfigError(f"no valid answer to {question!r} after {_ATTEMPTS} tries. Fix: answer with one of "
                          "the values listed, or press Enter for the default.", key=question, value=None,
                          valid="see the question")


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            raise ValueError(f"{value} is out of range; valid: {low}..{high if high is not None else ''}")
        return value
    return parse


def _choice(choices: tuple[S, ...]) -> Callable[[str], S]:
    def parse(text: str) -> S:
        for choice in choices:
            if text.lower() == choice:
                return choice
        raise ValueError(f"{text!r} is not one of {list(choices)}")
    return parse


def _yes_no(text: str) -> bool:
    if text.lower() in ("y", "yes", "true", "1"):
        return True
    if text.lower() in ("n", "no", "false", "0"):
        return False
    raise ValueError(f"{text!r} is not yes or no")


def _timeout(text: str) -> float | None:
    if text.lower() in ("none", "no", "0"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number of seconds (or 'none')") from None
    if value <= 0:
        raise ValueError(f"{value:g} is not a positive number of seconds (or 'none')")
    return value


def _gpu_ids(text: str) -> str:
    # the same ids a config accepts: positions among the visible GPUs, or UUIDs from `nvidia-smi -L`
    if text != "all" and not all(re.fullmatch(r"\d+|(GPU|MIG)-[\w\-/]+", p.strip()) for p in text.split(",")):
        raise ValueError(f"{text!r} is not 'all' or a list like '0,1' (or GPU UUIDs)")
    return text.replace(" ", "")


def _machines(ask: _Asker, base: LaunchConfig) -> dict[str, Any]:
    machines = ask.ask("How many machines take part?", base.num_machines, _int_in(1))
    if machines == 1:
        return {"num_machines": 1, "machine_rank": 0}
    return {
        "num_machines": machines,
        "machine_rank": ask.ask(f"Rank of this machine (0..{machines - 1})?", min(base.machine_rank, machines - 1),
                                _int_in(0, machines - 1)),
        "main_process_ip": ask.ask("IP address of machine 0?", base.main_process_ip or "127.0.0.1", str),
        "main_process_port": ask.ask("Port on machine 0 for the rendezvous?", base.main_process_port or 29500,
                                     _int_in(1, 65535)),
        "rdzv_backend": ask.ask("Rendezvous backend (static/c10d)?", base.rdzv_backend, _choice(("static", "c10d"))),
    }


def _ray_address(text: str) -> str | None:
    if text.lower() == "none":
        return None
    if text == "auto" or re.fullmatch(r"(ray://)?[\w.\-]+:\d+", text):
        return text
    raise ValueError(f"{text!r} is not 'none', 'auto', 'ray://host:port' or 'host:port'")


def _strategy(text: str) -> PlacementStrategy:
    strategies = get_args(PlacementStrategy)
    if text.upper() not in strategies:
        raise ValueError(f"{text!r} is not one of {list(strategies)}")
    return cast(PlacementStrategy, text.upper())  # one of its values, checked above


def _ray(ask: _Asker, base: LaunchConfig, machines: int) -> dict[str, Any]:
    """The Ray questions, asked last so piped answers for a local launch need not mention them."""
    if machines > 1:  # several machines by hand is torch elastic; Ray places ranks itself
        return {"backend": "local"}
    on_ray = ask.ask("Run the ranks on a Ray cluster (yes/no)?", base.backend == "ray", _yes_no,
                     "yes" if base.backend == "ray" else "no")
    if not on_ray:
        return {"backend": "local"}
    strategies = get_args(PlacementStrategy)
    return {
        "backend": "ray",
        "ray_address": ask.ask("Ray cluster address (none: the notebook's ray.init, else a new local instance; "
                               "auto; ray://host:10001)?", base.ray_address, _ray_address,
                               base.ray_address or "none"),
        "ray_placement_strategy": ask.ask(f"Placement of the ranks ({'/'.join(strategies)})?",
                                          base.ray_placement_strategy,
                                          _strategy),
    }


def ask_config(base: LaunchConfig, inp: TextIO, out: TextIO) -> LaunchConfig:
    """Ask the questions, defaults taken from ``base``; returns the answered config.

    Raises:
        ConfigError: a question got no valid answer, or the answers do not fit together.
    """
    ask = _Asker(inp, out)
    gpus = cuda_device_count()
    values: dict[str, Any] = _machines(ask, base)
    use_cpu = ask.ask("Run on CPU only (yes/no)?", base.use_cpu or not gpus, _yes_no,
                      "yes" if base.use_cpu or not gpus else "no")
    default_n = base.num_processes or (gpus if gpus and not use_cpu else min(cpu_count(), _MAX_DEFAULT_CPU_PROCESSES))
    n = ask.ask("How many processes on this machine?", default_n, _int_in(1))
    gpu_ids = (ask.ask("Which GPUs (for example 0,1, or all)?", base.gpu_ids, _gpu_ids) if gpus and not use_cpu
               else "all")
    precisions = get_args(MixedPrecision)
    mixed = ask.ask(f"Mixed precision ({'/'.join(precisions)})?", base.mixed_precision, _choice(precisions))
    method = ask.ask("Start method (auto/fork/spawn)?", base.start_method or "auto", _choice(("auto", "fork", "spawn")))
    timeout = ask.ask("Stop a launch after how many seconds (none for no limit)?", base.timeout, _timeout,
                      "none" if base.timeout is None else f"{base.timeout:g}")
    values.update(_ray(ask, base, values["num_machines"]))
    world = n * values["num_machines"]
    dtype: DistributedType | None
    if base.distributed_type in ("FSDP", "DEEPSPEED"):
        dtype = base.distributed_type
    elif world == 1:
        dtype = DistributedType.NO
    else:
        dtype = DistributedType.MULTI_CPU if use_cpu or not gpus else DistributedType.MULTI_GPU
    return LaunchConfig.from_mapping({
        **base.to_mapping(), **values, "distributed_type": dtype, "num_processes": world, "use_cpu": bool(use_cpu),
        "gpu_ids": gpu_ids, "mixed_precision": mixed, "start_method": None if method == "auto" else method,
        "timeout": timeout}, source="your answers")


def _existing(path: Path, out: TextIO) -> LaunchConfig:
    if not path.exists():
        return LaunchConfig()
    try:
        return load_config(path)
    except ConfigError as exc:
        out.write(f"The existing config file is invalid and will be replaced: {exc}\n")
        return LaunchConfig()


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel config`` to the command line."""
    parser = subparsers.add_parser(
        "config", help="write the launch config file (questions, or --default for this machine)",
        description="Write nbaccel's launch config file. Without --default, asks questions on stdin; "
                    "press Enter to take the default in brackets.")
    parser.add_argument("--config_file", "--config-file", default=None, metavar="PATH",
                        help="where to write (default: $NBACCEL_CONFIG_FILE or ~/.cache/nbaccel/default_config.yaml)")
    parser.add_argument("--default", action="store_true",
                        help="write a config for this machine without asking (every GPU, else CPU processes)")
    parser.add_argument("--mixed_precision", "--mixed-precision", choices=get_args(MixedPrecision), default="no",
                        help="with --default: the mixed precision to write")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the config file; 0 on success."""
    path = Path(args.config_file).expanduser() if args.config_file else config_file_path()
    if path.is_dir():
        raise ConfigError(f"--config_file {str(path)!r} is a directory. Fix: pass a file path such as "
                          f"{str(path / 'default_config.yaml')!r}.", key="config_file", value=str(path),
                          valid="a file path")
    if args.default:
        cfg = default_config(args.mixed_precision)
    else:
        sys.stdout.write("nbaccel config: press Enter to keep the value in brackets.\n")
        cfg = ask_config(_existing(path, sys.stdout), sys.stdin, sys.stdout)
    try:
        written = save_config(cfg, path)
    except OSError as exc:
        raise ConfigError(f"cannot write the config file {str(path)!r}: {exc.strerror}. Fix: pass a writable "
                          "--config_file path.", key="config_file", value=str(path), valid="a writable path") from None
    where = f"{cfg.num_processes} process(es)" if cfg.num_processes else "every TPU core"
    print(f"nbaccel config: wrote {written} ({cfg.distributed_type}, {where}, mixed_precision={cfg.mixed_precision})")
    return 0
