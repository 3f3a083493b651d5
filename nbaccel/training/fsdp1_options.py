"""FSDP1-style options of Accelerate's ``FullyShardedDataParallelPlugin``, mapped onto FSDP2 where they mean something.

nbaccel shards with FSDP2 (``fully_shard``) only. Users' plugins and config files still carry
FSDP1 options; each is here either translated (``sharding_strategy`` -> ``reshard_after_forward``),
accepted with a warning where FSDP2 already behaves that way or has no such knob, or refused with
the reason where honouring it would need something nbaccel does not do.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from nbaccel.errors import ConfigError

__all__ = ["FSDP1_OPTIONS", "SHARDING_STRATEGIES", "reshard_from_sharding_strategy", "translate_fsdp1_options"]

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
"""FSDP1's strategies in ``torch.distributed.fsdp.ShardingStrategy`` order (Accelerate also takes 1..5)."""

_NO_MEANING = {
    "backward_prefetch": "FSDP2 prefetches the next all-gather in backward by itself",
    "forward_prefetch": "FSDP2 overlaps forward all-gathers by itself",
    "use_orig_params": "FSDP2 always keeps the original parameters (as DTensors)",
    "sync_module_states": "prepare broadcasts rank 0's weights only into ranks that built the model on the meta "
                          "device (or with cpu_ram_efficient_loading); otherwise every rank keeps its own",
    "limit_all_gathers": "FSDP2 has no rate limiter to turn off",
}
# Honoured as in Accelerate, by nbaccel.training.fsdp_materialize: rank 0's weights broadcast into the shards.
_HONOURED = ("cpu_ram_efficient_loading",)
_REFUSED = {
    "ignored_modules": "FSDP2 sharding in nbaccel covers the whole model; move those modules out of it",
    "param_init_fn": "build the model on the meta device: prepare calls each module's reset_parameters() (or, "
                     "where rank 0 has real weights, broadcasts them into the shards)",
    "state_dict_config": "use state_dict_type='FULL_STATE_DICT' or 'SHARDED_STATE_DICT'",
    "optim_state_dict_config": "use state_dict_type='FULL_STATE_DICT' or 'SHARDED_STATE_DICT'",
    "activation_checkpointing": "wrap blocks with torch.utils.checkpoint in the model's forward",
    "activation_checkpointing_offload": "wrap blocks with torch.utils.checkpoint in the model's forward",
}
FSDP1_OPTIONS: tuple[str, ...] = ("sharding_strategy", *_NO_MEANING, *_HONOURED, *_REFUSED)
"""Every FSDP1-style option the plugin accepts by name."""


def reshard_from_sharding_strategy(strategy: object) -> bool:
    """``reshard_after_forward`` for an FSDP1 ``sharding_strategy`` (a name, 1..5, or torch's enum).

    ``FULL_SHARD`` (ZeRO-3) frees gathered parameters after forward; ``SHARD_GRAD_OP`` (ZeRO-2)
    keeps them until backward.

    Raises:
        ConfigError: an unknown strategy, or one FSDP2 in nbaccel has no counterpart for
            (``NO_SHARD``: use DDP; the hybrid strategies need a 2-D device mesh).

    Example:
        >>> reshard_from_sharding_strategy("SHARD_GRAD_OP"), reshard_from_sharding_strategy(1)
        (False, True)
    """
    name = getattr(strategy, "name", strategy)
    if isinstance(name, str) and name.isdigit():
        name = int(name)
    if isinstance(name, int) and not isinstance(name, bool) and 1 <= name <= len(SHARDING_STRATEGIES):
        name = SHARDING_STRATEGIES[name - 1]
    name = name.upper() if isinstance(name, str) else name
    if name == "FULL_SHARD":
        return True
    if name == "SHARD_GRAD_OP":
        return False
    fixes = {"NO_SHARD": "nothing is sharded under NO_SHARD: use DDP (distributed_type='MULTI_GPU') instead",
             "HYBRID_SHARD": "hybrid sharding needs a 2-D device mesh, which nbaccel does not build; use FULL_SHARD",
             "HYBRID_SHARD_ZERO2": "hybrid sharding needs a 2-D device mesh, which nbaccel does not build; use "
                                   "SHARD_GRAD_OP"}
    if name in fixes:
        raise ConfigError(f"`sharding_strategy` {name!r} has no FSDP2 counterpart in nbaccel: {fixes[name]}.",
                          key="sharding_strategy", value=strategy, valid=("FULL_SHARD", "SHARD_GRAD_OP"))
    raise ConfigError(f"`sharding_strategy` must be one of {list(SHARDING_STRATEGIES)} or 1..5 (got {strategy!r}). "
                      "Fix: use 'FULL_SHARD' (or reshard_after_forward=True).", key="sharding_strategy",
                      value=strategy, valid=SHARDING_STRATEGIES)


def translate_fsdp1_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The FSDP2 fields that ``options`` (FSDP1-style, unset ones ``None``) stand for; warns or refuses the rest.

    Returns:
        ``{"reshard_after_forward": ...}`` when ``sharding_strategy`` is set, else ``{}``.

    Raises:
        ConfigError: an option whose meaning FSDP2 in nbaccel cannot honour (see the module doc).

    Example:
        >>> translate_fsdp1_options({"sharding_strategy": "SHARD_GRAD_OP", "use_orig_params": None})
        {'reshard_after_forward': False}
    """
    fields: dict[str, Any] = {}
    for key, value in options.items():
        if value is None or value is False or (isinstance(value, str) and value.lower() in ("false", "0", "")):
            continue  # unset (config files carry booleans as strings)
        if key == "sharding_strategy":
            fields["reshard_after_forward"] = reshard_from_sharding_strategy(value)
        elif key in _NO_MEANING:
            warnings.warn(f"FullyShardedDataParallelPlugin({key}={value!r}) has no effect under FSDP2: "
                          f"{_NO_MEANING[key]}.", UserWarning, stacklevel=4)
        elif key in _REFUSED:
            raise ConfigError(f"FullyShardedDataParallelPlugin({key}=...) is an FSDP1 option nbaccel cannot honour "
                              f"under FSDP2. Fix: {_REFUSED[key]}.", key=key, value=value, valid=(None,))
    return fields
