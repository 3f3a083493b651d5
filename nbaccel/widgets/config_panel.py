"""The ``%accel_config`` panel: every `LaunchConfig` field, validated as you type, saved as YAML.

The fields come from :class:`~nbaccel.config.LaunchConfig` itself (a choice list for ``Literal``
and enum fields, a checkbox for booleans, a text box for numbers and strings, YAML for mappings), so the
panel never drifts from the config. "Save" writes the same file ``nbaccel config`` writes (via
:func:`~nbaccel.config.save_config`); "Use for this session" hands the values to the session
defaults of the following ``%%accel_launch`` cells. The plain-text form is :meth:`ConfigPanel.text`.
"""

from __future__ import annotations

import dataclasses
import enum
import html
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args, get_origin

import yaml

from nbaccel.config import LaunchConfig, changed_fields, save_config
from nbaccel.config_text import parse_config_text
from nbaccel.distributed_type import LAUNCHABLE_TYPES, DistributedType
from nbaccel.errors import ConfigError
from nbaccel.hardware import cpu_count, cuda_device_count, tpu_detected
from nbaccel.widgets import (
    import_widgets,
    set_titles,
    tooltip,
    widget_bundle,
    widgets_available,
)

__all__ = ["ConfigPanel", "FieldSpec", "field_specs", "widgets_available"]  # widgets_available: for %accel_config

_AUTO = "auto"
_PLACEHOLDERS = {"num_processes": "auto (one per GPU, else up to 4 CPUs)", "main_process_port": "auto (a free port)",
                 "timeout": "none (no limit)", "main_process_ip": "none (single machine)",
                 "ray_address": "auto (this kernel's Ray connection, else a local instance)"}
FieldKind = Literal["choice", "bool", "int", "float", "str", "mapping"]
_CSS = (".nbaccel-invalid input, .nbaccel-invalid textarea, .nbaccel-invalid select "
        "{border-color: #dc2626 !important; background: #fef2f2 !important}")
_GROUPS: dict[str, tuple[str, ...]] = {
    "Processes": ("num_processes", "mixed_precision", "use_cpu", "distributed_type", "gpu_ids",
                  "start_method", "timeout", "debug"),
    "Machines": ("num_machines", "machine_rank", "main_process_ip", "main_process_port", "rdzv_backend",
                 "same_network"),
    "Ray cluster": ("backend", "ray_address", "ray_placement_strategy"),
    "Scripts and plugins": ("main_training_function", "fsdp_config", "deepspeed_config", "extra"),
}


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """How one ``LaunchConfig`` field is edited.

    Attributes:
        name: the field name.
        kind: the editor used for it.
        optional: ``None`` is allowed (shown as ``auto`` or an empty box).
        choices: the valid values of a ``choice`` field.
        help: the field's description from ``LaunchConfig``'s docstring.
    """

    name: str
    kind: FieldKind
    optional: bool
    choices: tuple[Any, ...] = ()
    help: str = ""

    def parse(self, text: str) -> Any:
        """The value typed as ``text`` (text-box kinds).

        Raises:
            ConfigError: ``text`` is not a valid value of this kind.
        """
        text = text.strip()
        if text == "" and self.optional:
            return None
        try:
            if self.kind == "int":
                return int(text)
            if self.kind == "float":
                return float(text)
            if self.kind == "mapping":
                value = parse_config_text(text, source=self.name, as_json=False) if text else {}
                if not isinstance(value, Mapping):
                    raise ValueError("not a mapping")
                return dict(value)
        except (ValueError, yaml.YAMLError):
            what = {"int": "a whole number", "float": "a number", "mapping": "a YAML mapping like {key: value}"}
            empty = " or empty for auto" if self.optional else ""
            raise ConfigError(f"{self.name!r} must be {what[self.kind]}{empty} (got {text!r})",
                              key=self.name, value=text, valid=what[self.kind]) from None
        return text

    def show(self, value: Any) -> str:
        """``value`` as it is typed in this field's text box."""
        if value is None:
            return ""
        if self.kind == "mapping":
            return yaml.safe_dump(dict(value), default_flow_style=True).strip() if value else ""
        if self.kind == "float" and float(value).is_integer():
            return str(int(value))
        return str(value)


def _field_help() -> dict[str, str]:
    doc = LaunchConfig.__doc__ or ""
    found: dict[str, str] = {}
    for match in re.finditer(r"^ {8}(\w+): (.+?)(?=^ {8}\w+: |^\s*$|\Z)", doc, re.M | re.S):
        found[match[1]] = " ".join(match[2].replace("``", "").split())
    return found


def field_specs() -> list[FieldSpec]:
    """One :class:`FieldSpec` per ``LaunchConfig`` field, read from its type hints.

    Example:
        >>> [s.kind for s in field_specs() if s.name == "mixed_precision"]
        ['choice']
    """
    hints = typing.get_type_hints(LaunchConfig)
    helps = _field_help()
    specs = []
    for f in dataclasses.fields(LaunchConfig):
        tp, optional = hints[f.name], False
        if get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in get_args(tp) if a is not type(None)]
            optional, tp = True, args[0]
        if get_origin(tp) is Literal:
            spec = FieldSpec(f.name, "choice", optional, get_args(tp), helps.get(f.name, ""))
        elif isinstance(tp, type) and issubclass(tp, enum.Enum):
            # DistributedType names other hardware too; offer only what a launch takes (as the config checks)
            members = LAUNCHABLE_TYPES if tp is DistributedType else tuple(tp)
            spec = FieldSpec(f.name, "choice", optional, tuple(m.value for m in members), helps.get(f.name, ""))
        elif tp is bool:
            spec = FieldSpec(f.name, "bool", optional, (), helps.get(f.name, ""))
        elif tp in (int, float, str):
            spec = FieldSpec(f.name, tp.__name__, optional, (), helps.get(f.name, ""))
        else:
            spec = FieldSpec(f.name, "mapping", optional, (), helps.get(f.name, ""))
        specs.append(spec)
    return specs


def _hardware() -> str:
    gpus = cuda_device_count()
    return (f"{gpus} CUDA GPU{'s' if gpus != 1 else ''} · TPU {'found' if tpu_detected() else 'not found'} · "
            f"{cpu_count()} CPU{'s' if cpu_count() != 1 else ''}")


class ConfigPanel:
    """Edit a :class:`LaunchConfig` in a notebook; plain text where widgets cannot render.

    Args:
        config: the values shown first (the file's, with session defaults applied).
        path: the file "Save" writes.
        base: what "Use for this session" compares against (default: ``config``); only the
            fields that differ from it become session defaults.
        on_use: receives ``{field: value}`` when "Use for this session" is pressed.

    Example:
        >>> panel = ConfigPanel(load_config(), path=str(config_file_path()))  # doctest: +SKIP
        >>> panel  # in a notebook: the panel; elsewhere: the config as text  # doctest: +SKIP
    """

    def __init__(self, config: LaunchConfig, *, path: str, base: LaunchConfig | None = None,
                 on_use: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.config: LaunchConfig | None = config
        self.path = path
        self.base = base if base is not None else config
        self.on_use = on_use
        self.specs = {s.name: s for s in field_specs()}
        self.hardware = _hardware()
        self.error: ConfigError | None = None
        self._box: Any = None
        self._editors: dict[str, Any] = {}

    # ------------------------------------------------------------------ values
    def values(self) -> dict[str, Any]:
        """The editors' current values, parsed.

        Raises:
            ConfigError: a text box holds something that is not a value of its kind.
        """
        out: dict[str, Any] = {}
        for name, editor in self._editors.items():
            spec = self.specs[name]
            raw = editor.value
            if spec.kind == "choice":
                out[name] = None if raw == _AUTO and spec.optional else raw
            else:
                out[name] = raw if spec.kind == "bool" else spec.parse(raw)
        return out

    def validate(self) -> LaunchConfig | None:
        """Build the config from the editors; show what is wrong, or ``None`` when it is invalid."""
        try:
            self.config = LaunchConfig(**self.values())
            self.error = None
        except ConfigError as exc:
            self.config, self.error = None, exc
        self._show_validation()
        return self.config

    def save(self) -> str:
        """Write the current config to :attr:`path` as YAML; returns the path.

        Raises:
            ConfigError: the values shown are invalid (nothing is written).
        """
        config = self.validate() if self._editors else self.config
        if config is None:
            raise self.error or ConfigError("the configuration is invalid", key=None)
        written = str(save_config(config, self.path))
        self._say(f"Saved to {written}.")
        return written

    def use_for_session(self) -> dict[str, Any]:
        """Make the current values the session defaults; returns the fields that differ from the file.

        Raises:
            ConfigError: the values shown are invalid (the session is unchanged).
        """
        config = self.validate() if self._editors else self.config
        if config is None:
            raise self.error or ConfigError("the configuration is invalid", key=None)
        changed = changed_fields(config, self.base)
        if self.on_use is not None:
            self.on_use(changed)
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(changed.items())) or "the file's values"
        self._say(f"Following %%accel_launch cells in this session use: {shown}.")
        return changed

    # ------------------------------------------------------------------ text
    def text(self) -> str:
        """The config as text, with where it is saved and how to edit it."""
        config = self.config or self.base
        lines = [f"nbaccel launch configuration ({self.path})", f"detected hardware: {self.hardware}"]
        for spec in self.specs.values():
            value = getattr(config, spec.name)
            if value is None:
                shown = "auto" if spec.kind in ("choice", "int") else "none"
            else:
                shown = spec.show(value) or "{}"
            lines.append(f"  {spec.name}: {shown}")
        lines.append("Edit it with `nbaccel config` in a terminal, or with %accel_config in a notebook "
                     "where ipywidgets renders.")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    # ------------------------------------------------------------------ widgets
    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        return widget_bundle(self.widget(), self.text())

    def widget(self) -> Any:
        """The ipywidgets panel (built on first use).

        Raises:
            MissingDependencyError: ipywidgets is not installed.
        """
        if self._box is None:
            self._box = self._build(import_widgets("the %accel_config panel"))
        return self._box

    def _editor(self, w: Any, spec: FieldSpec, value: Any) -> Any:
        common = {"description": spec.name, "style": {"description_width": "170px"},
                  "layout": w.Layout(width="420px" if spec.kind != "mapping" else "640px"),
                  **tooltip(spec.help)}
        if spec.kind == "choice":  # None shows as "auto" (a Dropdown cannot show a None value)
            options = ([_AUTO] if spec.optional else []) + [str(c) for c in spec.choices]
            editor = w.Dropdown(options=options, value=_AUTO if value is None else str(value), **common)
        elif spec.kind == "bool":
            editor = w.Checkbox(value=bool(value), indent=True, **common)
        elif spec.kind == "mapping":
            editor = w.Textarea(value=spec.show(value), placeholder="{}", continuous_update=True, **common)
        else:
            placeholder = _PLACEHOLDERS.get(spec.name, "none") if spec.optional else ""
            editor = w.Text(value=spec.show(value), placeholder=placeholder, continuous_update=True, **common)
        editor.add_class(f"nbaccel-field-{spec.name}")
        editor.observe(lambda _change: self.validate(), names="value")
        return editor

    def _build(self, w: Any) -> Any:
        config = self.config or self.base
        groups = []
        grouped = {n for names in _GROUPS.values() for n in names}
        others = tuple(n for n in self.specs if n not in grouped)  # fields added to LaunchConfig later
        for title, names in _GROUPS.items():
            rows = []
            for name in names + (others if title == list(_GROUPS)[-1] else ()):
                self._editors[name] = self._editor(w, self.specs[name], getattr(config, name))
                rows.append(self._editors[name])
            groups.append((title, w.VBox(rows)))
        self._message = w.HTML()
        self._message.add_class("nbaccel-message")
        self._save = w.Button(description="Save", button_style="primary", icon="save",
                              tooltip=f"write {self.path}")
        self._save.add_class("nbaccel-save")
        self._use = w.Button(description="Use for this session", icon="check", layout=w.Layout(width="auto"),
                             tooltip="make these the defaults of the next %%accel_launch cells")
        self._use.add_class("nbaccel-use")
        self._save.on_click(lambda _b: self._click(self.save))
        self._use.on_click(lambda _b: self._click(self.use_for_session))
        more = w.Accordion(children=[box for _, box in groups[1:]], selected_index=None)
        set_titles(more, [t for t, _ in groups[1:]])
        heading = w.HTML(f"<style>{_CSS}</style><b>nbaccel launch configuration</b> · detected: {self.hardware}"
                         f"<br><small>file: <code>{html.escape(self.path)}</code></small>")
        box = w.VBox([heading, groups[0][1], more, self._message, w.HBox([self._save, self._use])])
        box.add_class("nbaccel-config")
        self.validate()
        return box

    def _click(self, action: Callable[[], Any]) -> None:
        try:
            action()
        except ConfigError as exc:
            self._say(f"Not done: {exc}", error=True)

    def _say(self, text: str, error: bool = False) -> None:
        if hasattr(self, "_message"):
            color = "#dc2626" if error else "#16a34a"
            self._message.value = f"<span style='color:{color}'>{html.escape(text, quote=False)}</span>"
            self._error_shown = error

    def _show_validation(self) -> None:
        if not hasattr(self, "_message"):
            return
        bad = self.error.key if self.error is not None else None
        for name, editor in self._editors.items():
            if name == bad:
                editor.add_class("nbaccel-invalid")
            else:
                editor.remove_class("nbaccel-invalid")
        ok = self.error is None
        self._save.disabled = not ok
        self._use.disabled = not ok
        if not ok:
            self._say(str(self.error), error=True)
        elif getattr(self, "_error_shown", False):
            self._message.value = ""
            self._error_shown = False
