"""Facts read off objects and the process, under Accelerate's names: display names, loaded libraries, model facts.

Every function here only reads: it imports nothing new (``sys.modules`` answers which libraries are
loaded) and changes no object it is given.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any, cast

from torch import nn

__all__ = ["are_libraries_initialized", "check_tied_parameters_in_config", "do_nothing", "get_model_tp_size",
           "get_pretty_name", "model_has_dtensor"]

_log = logging.getLogger(__name__)


def get_pretty_name(obj: Any) -> str:
    """The qualified name of ``obj``, or of its class when it has none (an instance).

    Example:
        >>> get_pretty_name(nn.Linear), get_pretty_name(nn.Linear(1, 1)), get_pretty_name(3)
        ('Linear', 'Linear', 'int')
    """
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or str(obj)


def are_libraries_initialized(*library_names: str) -> list[str]:
    """Those of ``library_names`` already imported in this process (nothing is imported to find out).

    Example:
        >>> are_libraries_initialized("sys", "surely_not_imported_here")
        ['sys']
    """
    return [name for name in library_names if name in sys.modules]


def do_nothing(*args: Any, **kwargs: Any) -> None:
    """Take anything and return ``None`` (a stand-in callable, as in Accelerate's ``accelerate.state``).

    Example:
        >>> do_nothing(1, key="value") is None
        True
    """
    return None


def get_model_tp_size(model: nn.Module) -> int | None:
    """The tensor-parallel size a transformers model was loaded with, ``None`` when it has none.

    transformers before 5 keeps it on the model (``model.tp_size``); from 5 on, in
    ``model.config.distributed_config`` (an object or a dict), with ``model.tp_size`` left ``None``.

    Example:
        >>> get_model_tp_size(nn.Linear(1, 1)) is None
        True
    """
    tp_size = getattr(model, "tp_size", None)
    if tp_size is not None:
        return tp_size
    distributed_config = getattr(getattr(model, "config", None), "distributed_config", None)
    if isinstance(distributed_config, dict):
        return distributed_config.get("tp_size")
    return getattr(distributed_config, "tp_size", None)


def model_has_dtensor(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (sharded by FSDP2 or tensor parallelism).

    Example:
        >>> model_has_dtensor(nn.Linear(1, 1))
        False
    """
    import torch.distributed

    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def check_tied_parameters_in_config(model: nn.Module) -> bool:
    """Whether a transformers model's configuration says some of its weights should be tied.

    True for a ``PreTrainedModel`` whose (decoder) config has ``tie_word_embeddings`` and which has
    output embeddings, one with ``is_encoder_decoder`` and ``tie_encoder_decoder``, or one with a
    submodule defining ``_tie_weights``; always false for other models.

    Example:
        >>> check_tied_parameters_in_config(nn.Linear(1, 1))
        False
    """
    if "PreTrainedModel" not in [c.__name__ for c in inspect.getmro(type(model))]:
        return False
    config = getattr(model, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    text = get_text_config(decoder=True) if get_text_config is not None else config
    pretrained = cast(Any, model)  # a transformers PreTrainedModel (checked above), untyped here
    word_embeddings = bool(text is not None and getattr(text, "tie_word_embeddings", False)
                           and pretrained.get_output_embeddings())
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False)
                           and getattr(config, "tie_encoder_decoder", False))
    return word_embeddings or encoder_decoder or any(hasattr(m, "_tie_weights") for m in model.modules())
