"""The Accelerator's saving and loading: state dicts, `save_model`, `save`, `save_state` / `load_state`.

Kept apart from :mod:`nbaccel.training.accelerator` so that module stays about training. A mixin: it
needs the Accelerator's ``state``, ``project_configuration`` and ``prepared`` registry; the
training state is written by :mod:`nbaccel.training.training_state`, the file formats are
:mod:`nbaccel.training.checkpointing`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from nbaccel.errors import ConfigError
from nbaccel.file_size import convert_file_size_to_int
from nbaccel.process_state import ProcessState
from nbaccel.training import checkpointing, state_loading, training_state
from nbaccel.training.plugins import (
    FullyShardedDataParallelPlugin,
    ProjectConfiguration,
)
from nbaccel.training.prepared import (
    LoadStatePreHook,
    PreparedObjects,
    SaveStatePreHook,
)

__all__ = ["CheckpointHelpers"]


class CheckpointHelpers:
    """Mixin: saving and loading what an Accelerator prepared (see the module docstring)."""

    state: ProcessState
    project_configuration: ProjectConfiguration
    prepared: PreparedObjects
    step: int
    scaler: Any
    fsdp_plugin: FullyShardedDataParallelPlugin | None

    if TYPE_CHECKING:  # the Accelerator's property and ProcessHelpers' method, beside this in the Accelerator
        @property
        def device(self) -> torch.device: ...
        def wait_for_everyone(self) -> None: ...

    def _checkpoint_context(self) -> training_state.CheckpointContext:
        """What ``save_state``/``load_state`` need besides the prepared objects, read from this Accelerator."""
        plugin = self.fsdp_plugin
        return training_state.CheckpointContext(
            process=self.state, project=self.project_configuration, scaler=self.scaler, step=self.step,
            sharded_fsdp=plugin is not None and plugin.state_dict_type == "SHARDED_STATE_DICT")

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict on CPU (gathered from the shards under FSDP: call on every rank)."""
        return training_state.model_state_dict(model, unwrap=unwrap)

    def save_model(self, model: torch.nn.Module, save_directory: str | Path, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:
        """Save the model's weights, sharded into ``max_shard_size`` files with an ``*.index.json`` map.

        Call on every process (FSDP gathers the shards); only the main process writes.

        Raises:
            ConfigError: ``save_directory`` is an existing file, or ``max_shard_size`` is invalid.

        Example:
            >>> accelerator.save_model(model, "out", max_shard_size="200MB")   # doctest: +SKIP
        """
        folder = Path(save_directory)
        if folder.is_file():
            raise ConfigError(f"`save_directory` must be a folder, but {str(folder)!r} is a file; pass a folder path",
                              key="save_directory", value=str(folder), valid="a folder path")
        convert_file_size_to_int(max_shard_size, key="max_shard_size")
        from nbaccel.training.fsdp import is_fsdp_model

        context = self._checkpoint_context()
        # FSDP gathers onto every node's writer (one more collective to learn who they are); other models
        # are whole on every rank already.
        writers = context.writer_ranks() if is_fsdp_model(model) else (0,)
        state_dict = training_state.model_state_dict(model, ranks=writers)
        if context.is_writer:
            checkpointing.save_model_shards(state_dict, folder, max_shard_size, safe_serialization)
        self.wait_for_everyone()

    def save(self, obj: Any, f: str | Path, safe_serialization: bool = False) -> None:
        """Save ``obj`` once per job (main process), through CPU (``xm.save`` on XLA)."""
        if self.device.type == "xla":
            import torch_xla.core.xla_model as xm

            xm.save(obj, f)
            return
        if not self._is_writer():
            return
        if safe_serialization:
            checkpointing.write_weights(obj, Path(f), True)
        else:
            torch.save(obj, f)

    def _is_writer(self) -> bool:
        return self._checkpoint_context().is_writer

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include ``objects`` (anything with ``state_dict`` and ``load_state_dict``) in ``save_state``.

        Raises:
            ConfigError: an object lacks ``state_dict`` or ``load_state_dict``.
        """
        bad = [f"item {i} ({type(o).__name__})" for i, o in enumerate(objects)
               if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))]
        if bad:
            raise ConfigError(f"register_for_checkpointing needs objects with `state_dict` and `load_state_dict`; "
                              f"these have not: {', '.join(bad)}", key="objects", value=bad,
                              valid="objects with state_dict() and load_state_dict()")
        self.prepared.custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: SaveStatePreHook) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` in :meth:`save_state`, before the weights are written.

        ``models`` lists the prepared models, ``weights`` the state dicts about to be written as
        ``model.safetensors``, ``model_1.safetensors``, ... (remove one to save it your own way),
        and ``output_dir`` the folder being written (a temporary sibling of the checkpoint folder,
        swapped into place when every process is done, so files written there are kept). Runs
        on every process, as in Accelerate.

        Returns:
            A handle whose ``remove()`` unregisters the hook.

        Example:
            >>> def save_config(models, weights, output_dir):            # doctest: +SKIP
            ...     Path(output_dir, "config.json").write_text("{}")
            >>> handle = accelerator.register_save_state_pre_hook(save_config)   # doctest: +SKIP
        """
        hooks = self.prepared.save_state_pre_hooks
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: LoadStatePreHook) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` in :meth:`load_state`, before the weights are read.

        ``models`` lists the prepared models whose weights :meth:`load_state` will read from
        ``model.safetensors``, ``model_1.safetensors``, ... in order (remove one to load it your
        own way); ``input_dir`` is the checkpoint folder.

        Returns:
            A handle whose ``remove()`` unregisters the hook.

        Example:
            >>> handle = accelerator.register_load_state_pre_hook(lambda models, input_dir: None)   # doctest: +SKIP
            >>> handle.remove()                                                                     # doctest: +SKIP
        """
        hooks = self.prepared.load_state_pre_hooks
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def save_state(self, output_dir: str | Path | None = None, safe_serialization: bool = True) -> str:
        """Save models, optimizers, schedulers, dataloaders, scaler, RNG states and registered objects.

        Atomic: a crash at any point of a save (or of two in a row) leaves a complete checkpoint
        that :meth:`load_state` finds, the previous one or the new one. Processes saving into one
        folder take turns, and a :meth:`load_state` beside a save reads one whole save. Everything written loads
        with ``weights_only=True``; a registered object whose ``state_dict()`` holds other
        objects gets a warning, since :meth:`load_state` would refuse it by default. With
        ``ProjectConfiguration(automatic_checkpoint_naming=True)`` and no ``output_dir``, the folder
        is ``project_dir/checkpoints/checkpoint_<save_iteration>``, as in Accelerate.

        Raises:
            CheckpointError: the automatic checkpoint folder exists already.

        Example:
            >>> accelerator.save_state("ckpt/step_100")   # doctest: +SKIP
        """
        return str(training_state.save_accelerator_state(self.prepared, self._checkpoint_context(), output_dir,
                                                         safe_serialization))

    def load_state(self, input_dir: str | Path | None = None, load_kwargs: dict[str, Any] | None = None,
                   strict: bool = True) -> str:
        """Restore everything :meth:`save_state` wrote (default: the latest complete automatic checkpoint).

        Safe by default: every file is loaded with ``weights_only=True`` (tensors, numbers,
        strings, containers and NumPy arrays only), so a hostile folder runs no code; and every
        file is read and checked before anything changes, so a refused load leaves the models,
        optimizers, schedulers and registered objects as they were.

        Args:
            input_dir: the checkpoint folder.
            load_kwargs: extra keyword arguments for ``torch.load`` of every pickle file (as in
                Accelerate, where they reach the optimizer, scheduler and dataloader files).
                ``{"weights_only": False}`` allows full unpickling: only for folders you trust.
            strict: model keys must match the checkpoint's exactly.

        Raises:
            UnsafeCheckpointError: a file would run code when loaded (it names the file and the opt-in).
            CheckpointMismatchError: the checkpoint does not fit a model or optimizer (file, keys, shapes).
            CheckpointError: no complete checkpoint there, or a file is missing, truncated or corrupt.

        Example:
            >>> accelerator.load_state("ckpt/step_100")   # doctest: +SKIP
            >>> accelerator.load_state("downloaded", load_kwargs={"weights_only": False})   # doctest: +SKIP
        """
        loaded = state_loading.load_accelerator_state(self.prepared, self._checkpoint_context(), input_dir, strict,
                                                       load_kwargs)
        if loaded.step is not None:
            self.step = loaded.step
        return str(loaded.path)

