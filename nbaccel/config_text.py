"""Reading a config file's text into plain data, with bounded cost: size, aliases and nesting capped.

A config file comes from anywhere (a shared folder, a repository, a colleague). Whatever it
holds, reading it costs at most :data:`MAX_CONFIG_BYTES` of text, :data:`MAX_EXPANDED_NODES`
values once YAML aliases are expanded, and :data:`MAX_DEPTH` levels of nesting; past any of
these, and for a file that is not a regular file (a FIFO would block forever), the answer is a
one-line :class:`~nbaccel.errors.ConfigError` naming the file and the limit, in milliseconds. A
476-byte "billion laughs" YAML (nine levels of ten aliases each) is refused while composing,
before anything is built. Accelerate's own config files are a few dozen values, two levels deep.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from nbaccel.errors import ConfigError
from nbaccel.file_kinds import kind_of_mode

__all__ = ["MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_EXPANDED_NODES", "parse_config_text", "read_config_file"]

MAX_CONFIG_BYTES = 1 << 20
"""The largest config file read (1 MiB; Accelerate's files are under 2 KB)."""
MAX_EXPANDED_NODES = 10_000
"""The most values a YAML document may stand for once every alias is expanded."""
MAX_DEPTH = 64
"""The deepest nesting of mappings and lists accepted."""


class _Refused(Exception):
    """Raised inside the loader: the document passed a limit (``what`` says which)."""

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(what)
        self.what, self.limit = what, limit


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, counting nesting while it composes and expanded size once it has."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _Refused("nesting deeper than", MAX_DEPTH)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Any:
        node = super().compose_document()
        _check_expanded_size(node)
        return node


def _check_expanded_size(root: Any) -> None:
    """Raise when ``root`` stands for more than :data:`MAX_EXPANDED_NODES` values with aliases expanded.

    An alias shares its anchor's node, so each node's expanded size is computed once (memoized):
    the cost is the number of distinct nodes, not the (possibly astronomical) expanded count.
    """
    sizes: dict[int, int] = {}

    def size(node: Any) -> int:  # depth is already bounded by MAX_DEPTH
        known = sizes.get(id(node))
        if known is not None:
            return known
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        if total > MAX_EXPANDED_NODES:
            raise _Refused("more values, once its aliases are expanded, than", MAX_EXPANDED_NODES)
        sizes[id(node)] = total
        return total

    if root is not None:
        size(root)


def _json_depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _refusal(file: str, what: str, limit: int, fix: str) -> ConfigError:
    return ConfigError(f"config file {file!r} was refused: it holds {what} {limit:,}. Fix: {fix}",
                       key="config_file", value=file, valid=f"at most {limit:,}")


def parse_config_text(text: str, *, source: str, as_json: bool) -> Any:
    """Parse ``text`` (YAML, or JSON when ``as_json``) into plain data, within the limits above.

    Raises:
        ConfigError: the text is not valid YAML/JSON, or passes a limit (one line, bounded length).

    Example:
        >>> parse_config_text("num_processes: 2", source="config.yaml", as_json=False)
        {'num_processes': 2}
    """
    fix = "write the settings out plainly, without anchors and aliases (or rewrite the file with `nbaccel config`)"
    try:
        if as_json:
            data = json.loads(text)
            if _json_depth(data) > MAX_DEPTH:
                raise _Refused("nesting deeper than", MAX_DEPTH)
            return data
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except _Refused as exc:
        raise _refusal(source, exc.what, exc.limit, fix) from None
    except RecursionError:  # json's C parser recurses per level
        raise _refusal(source, "nesting deeper than", MAX_DEPTH, fix) from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        first = " ".join(str(exc).split())[:300]  # one line, bounded
        raise ConfigError(f"config file {source!r} is not valid {'JSON' if as_json else 'YAML'}: {first}. Fix: "
                          "correct the line named, or rewrite the file with `nbaccel config`",
                          key="config_file", value=source, valid="YAML or JSON") from None


def read_config_file(file: Path) -> str:
    """The text of the config file ``file``: a regular file of at most :data:`MAX_CONFIG_BYTES`, UTF-8.

    Raises:
        ConfigError: ``file`` is not a regular file, is too large, unreadable or not UTF-8.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "c.yaml"; _ = path.write_text("num_processes: 2")
        >>> read_config_file(path)
        'num_processes: 2'
    """
    name = str(file)
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)  # a FIFO must not block the open
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {name!r}: {exc.strerror}. Fix: pass a readable file",
                          key="config_file", value=name, valid="a readable file") from None
    try:
        kind = kind_of_mode(os.fstat(fd).st_mode)
        if kind is not None:
            raise ConfigError(f"config file {name!r} is not a regular file (it is a {kind}). Fix: pass the "
                              "path of an ordinary YAML or JSON file", key="config_file", value=name,
                              valid="a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(os.dup(fd), "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_CONFIG_BYTES:
        raise _refusal(name, "more bytes than", MAX_CONFIG_BYTES, "a launch config is a few dozen lines; pass "
                       "the right file, or move large data out of it")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {name!r} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                          f"{exc.start}). Fix: save it as UTF-8, or rewrite it with `nbaccel config`",
                          key="config_file", value=name, valid="a UTF-8 YAML or JSON file") from None

