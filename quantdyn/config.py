"""Typed, frozen configuration: dataclasses <-> dicts/YAML, dotted overrides.

Every config in quantdyn is a frozen dataclass with a docstring per field and
validation in ``__post_init__``.  This module turns nested dicts (from YAML or
``key=value`` overrides) into those dataclasses, refusing unknown keys with a
did-you-mean, and back into plain dicts for saving into every artifact.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from quantdyn.errors import QuantdynError, did_you_mean

C = TypeVar("C")


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML/CLI value into the annotated type (nested dataclasses,
    Optional, tuples, floats written as ints)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        last: Exception | None = None
        for a in args:
            try:
                return _coerce(value, a, where)
            except (QuantdynError, TypeError, ValueError) as e:  # try the next member
                last = e
        raise QuantdynError(f"{where}: cannot read {value!r} as {tp}") from last
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise QuantdynError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, where)
    if origin in (tuple, list):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            value = [value]
        args = typing.get_args(tp)
        inner = args[0] if args else Any
        out = [_coerce(v, inner, where) for v in value]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise QuantdynError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool):
            raise QuantdynError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise QuantdynError(f"{where}: expected a number, got {value!r}") from None
    if tp is int:
        if isinstance(value, bool):
            raise QuantdynError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if float(value).is_integer() else int(value)
            except ValueError:
                raise QuantdynError(f"{where}: expected an integer, got {value!r}") from None
        if not isinstance(value, int):
            raise QuantdynError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise QuantdynError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, (str, int, float)):
            raise QuantdynError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def moved_keys(cls) -> dict[str, str]:
    """Keys a config still reads where they used to be: ``{old key: dotted new place}`` (the class attribute
    ``MOVED``, e.g. a sweep's flat ``batch_size`` now lives at ``engine.batch_size``). Files written before the
    move load unchanged; ``to_dict`` writes the new place."""
    return dict(getattr(cls, "MOVED", {}) or {})


def _move_keys(cls, data: dict[str, Any], where: str) -> dict[str, Any]:
    """``data`` with the moved keys of ``cls`` put at their new place (``set_dotted``; the new place given too and
    different: an error naming both)."""
    for old, new in moved_keys(cls).items():
        if old not in data:
            continue
        value, path = data.pop(old), new.split(".")
        node = data
        for part in path[:-1]:
            node = node.get(part) if isinstance(node.get(part), dict) else {}
        if path[-1] in node and node[path[-1]] != value:
            at = f"{where}." if where else ""
            raise QuantdynError(f"config keys '{at}{old}' and '{at}{new}' are the same setting with different "
                                f"values ({value!r} and {node[path[-1]]!r}); keep '{at}{new}'")
        data = set_dotted(data, path, value)
    return data


@functools.lru_cache(maxsize=None)
def field_docs(cls_or_path) -> dict[str, str]:
    """``{field: its docstring on one line}`` of a config dataclass, read from its source text without importing
    it: ``cls_or_path`` is the class, or ``"package/module.py:ClassName"`` under the quantdyn package (so a
    command's ``-h`` can show a torch-importing module's field docs without importing torch). A field's help is
    then written once, in the config (used for the CLI options that set it)."""
    import ast
    import inspect
    import textwrap

    if isinstance(cls_or_path, str):
        rel, _, name = cls_or_path.partition(":")
        text = (Path(__file__).parent / rel).read_text(encoding="utf-8")
    else:
        text, name = textwrap.dedent(inspect.getsource(cls_or_path)), cls_or_path.__name__
    tree = ast.parse(text)
    node = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)
    if node is None:
        raise QuantdynError(f"no config class {name} in {cls_or_path}")
    out, body = {}, node.body
    for a, b in zip(body, body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            out[a.target.id] = " ".join(b.value.value.split())
    return out


def from_dict(cls: type[C], data: dict[str, Any] | None, where: str = "") -> C:
    """Build dataclass ``cls`` from a nested dict; unknown keys are an error (keys of ``cls.MOVED`` are read at
    their new place: ``moved_keys``)."""
    data = _move_keys(cls, dict(data or {}), where)
    types_ = _field_types(cls)
    unknown = [k for k in data if k not in types_]
    if unknown:
        k = unknown[0]
        key = f"{where}.{k}" if where else k
        raise QuantdynError(
            f"unknown config key '{key}'{did_you_mean(k, types_)}; valid keys"
            f"{' under ' + where if where else ''}: {', '.join(sorted(types_))}"
        )
    kwargs = {}
    for k, v in data.items():
        key = f"{where}.{k}" if where else k
        kwargs[k] = _coerce(v, types_[k], key)
    try:
        return cls(**kwargs)
    except QuantdynError:
        raise
    except (TypeError, ValueError) as e:
        raise QuantdynError(f"{where or cls.__name__}: {e}") from None


OMIT_DEFAULT = {"omit_default": True}
"""Metadata of a dataclass field that :func:`to_dict` leaves out while it holds its default: a field added to a
config whose hash keys stored rows (QuantConfig) keeps every earlier config's hash."""


def shared_fields(cfg: Any, cls, but: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of config ``cfg`` that config class ``cls`` has under the same name (less ``but``): how a
    setting travels down a layer unrenamed (e.g. MeasureConfig -> WalkConfig)."""
    own = {f.name for f in dataclasses.fields(cfg)}
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)
            if f.init and f.name in own and f.name not in but}


def to_dict(cfg: Any) -> Any:
    """Dataclass (possibly nested) -> plain JSON/YAML-ready dict (fields marked OMIT_DEFAULT only when set)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                if not (f.metadata.get("omit_default") and getattr(cfg, f.name) == f.default)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, Path):
        return str(cfg)
    return cfg


def config_hash(cfg: Any, n: int = 12) -> str:
    """Stable short hash of a config (dataclass or dict)."""
    blob = json.dumps(to_dict(cfg), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


def parse_override(text: str) -> tuple[list[str], Any]:
    """'optim.lr=3e-3' -> (['optim', 'lr'], 0.003); values parsed as YAML."""
    if "=" not in text:
        raise QuantdynError(f"override '{text}' is not of the form key=value (e.g. optim.lr=3e-3)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise QuantdynError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def set_dotted(data: dict, path: list[str], value: Any) -> dict:
    """Return a copy of nested dict ``data`` with ``path`` set to ``value``."""
    out = dict(data)
    node = out
    for p in path[:-1]:
        child = node.get(p)
        child = dict(child) if isinstance(child, dict) else {}
        node[p] = child
        node = child
    node[path[-1]] = value
    return out


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """``data`` with each ``key.sub=value`` override set (values parsed as YAML: numbers, lists, null)."""
    for o in overrides:
        path, value = parse_override(o)
        data = set_dotted(data, path, value)
    return data


def load_yaml(path: str | Path) -> dict:
    """The mapping in the YAML file ``path`` ({} when empty); a missing, non-UTF-8, invalid or non-mapping
    file is one QuantdynError saying what to fix."""
    p = Path(path)
    if not p.is_file():
        raise QuantdynError(f"config file '{p}' does not exist; pass the path of a YAML file (see configs/)")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise QuantdynError(f"config file '{p}' is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise QuantdynError(f"config file '{p}' is not valid YAML{at}; fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise QuantdynError(f"config file '{p}' must hold a mapping of keys, not {type(data).__name__}")
    return data


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(to_dict(data), sort_keys=False)


# ------------------------------------------------------------------ dotted keys
def _dataclass_of(tp: Any):
    if dataclasses.is_dataclass(tp):
        return tp
    for a in typing.get_args(tp):
        if dataclasses.is_dataclass(a):
            return a
    return None


def _is_mapping(tp: Any) -> bool:
    return tp is dict or typing.get_origin(tp) is dict


def config_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of the config dataclass ``cls``, leaves and sections."""
    out = []
    for f, tp in typing.get_type_hints(cls).items():
        if f not in {x.name for x in dataclasses.fields(cls) if x.init}:
            continue
        key = f"{prefix}{f}"
        out.append(key)
        sub = _dataclass_of(tp)
        if sub is not None:
            out += config_keys(sub, key + ".")
    return out


def check_config_key(cls, key: str, what: str = "override") -> None:
    """Raise a QuantdynError with a did-you-mean if the dotted ``key`` names no value of ``cls`` (a section or
    an unknown name); a free-form mapping (e.g. optim.extra) takes any sub-key.  ``what`` starts the message
    (e.g. '--vary')."""
    top = cls
    parts = key.split(".")
    if parts[0] in moved_keys(cls):  # a moved key, at its new place
        parts = moved_keys(cls)[parts[0]].split(".") + parts[1:]
        key = ".".join(parts)
    for i, part in enumerate(parts):
        hints = {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls) if f.init}
        if part not in hints:
            known = config_keys(top)
            hint = did_you_mean(key, known)
            if not hint:  # e.g. 'lr' for 'optim.lr': match the last component
                same_leaf = [k for k in known if k.rsplit(".", 1)[-1] == parts[-1]]
                hint = f" (did you mean '{same_leaf[0]}'?)" if same_leaf else did_you_mean(part, hints)
            under = f" under '{'.'.join(parts[:i])}'" if i else ""
            raise QuantdynError(
                f"{what} {key}: unknown config key '{key}'{hint}; valid keys{under}: {', '.join(sorted(hints))}"
            )
        tp = hints[part]
        if _is_mapping(tp):
            return
        sub = _dataclass_of(tp)
        if sub is None:
            if i < len(parts) - 1:
                raise QuantdynError(f"{what} {key}: '{'.'.join(parts[: i + 1])}' is a value, not a section")
            return
        if i == len(parts) - 1:
            first = dataclasses.fields(sub)[0].name
            raise QuantdynError(f"{what} {key}: '{key}' is a section; give one of its keys, e.g. '{key}.{first}'")
        cls = sub
