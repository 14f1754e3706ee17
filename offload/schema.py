"""The building blocks of every configuration model (offload.yaml, backends, storage, autoscale, alerts, the
simulator), and the one translation of pydantic's errors into a `ConfigError` that names the field.

A leaf module (it imports only offload.errors and offload.suggest), so any model module, the simulator's included,
can build on it without an import cycle. The models themselves are validated once, by
`offload.config.load_settings` (or by the one `parse` call of a programmatic caller), and passed on as typed objects.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, StringConstraints, TypeAdapter, ValidationError

from offload.errors import ConfigError
from offload.suggest import closest, did_you_mean

T = TypeVar("T")
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

NonEmpty = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|sec|second|m|min|minute|h|hour)\s*$")
_PER = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600}


class Strict(BaseModel):
    """Unknown keys are errors: a typo (`endpoint_ulr`, a misspelt fault) would otherwise run on a default nobody
    chose, or silently test nothing."""

    model_config = ConfigDict(extra="forbid")


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: Any) -> float:
    """`30s`, `5m`, `1h30m`, `250ms` or a bare number of seconds -> seconds."""
    if isinstance(value, bool):
        raise ValueError("a duration must be a number of seconds or text like '30s', '5m', '1h30m'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION_PART.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise ValueError(f"bad duration {value!r}: use e.g. '30s', '5m', '1h30m' or seconds") from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        raise ValueError("a duration must be a number of seconds or text like '30s'")
    if seconds < 0:
        raise ValueError("a duration cannot be negative")
    return seconds


def parse_rate(text: str) -> float:
    """'20/s' -> 20.0 requests per second."""
    m = RATE_RE.match(text)
    if not m:
        raise ValueError(f"rate limit must look like '20/s', '600/min' or '1000/hour', got {text!r}")
    return float(m.group(1)) / _PER[m.group(2)]


def parse_networks(values: Iterable[str]) -> tuple[Network, ...]:
    """CIDRs (or bare addresses) as networks; a ValueError names the first one that is neither."""
    out = []
    for value in values:
        try:
            out.append(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address or CIDR (e.g. 10.0.0.0/8, ::1)") from None
    return tuple(out)


def http_url(value: str | None) -> str | None:
    """An http(s) URL without its trailing slash (every backend appends paths to it)."""
    if value is None:
        return None
    if not value.startswith(("http://", "https://")):  # the value is not echoed: it may carry user:password@
        raise ValueError("must be an http:// or https:// URL")
    return value.rstrip("/")


def parse(model: type[T] | Any, data: Any, where: str = "") -> T:
    """Validate `data` against `model` (a model class or an Annotated union) once; a ConfigError names the field
    of the first problem, under the path `where` (e.g. `backends.sdxl`)."""
    try:
        result: T = TypeAdapter(model).validate_python(data)
    except ValidationError as exc:
        raise field_error(exc, where, data) from None
    return result


def field_error(exc: ValidationError, where: str = "", data: Any = None) -> ConfigError:
    """The first problem of `exc` (an unknown key before all else) as `<field path>: <what is wrong>`. `data` is
    the validated input: with it, the union tags pydantic puts into the path (`backends.b.runpod.endpoint_id`) are
    dropped, since no one can type them into offload.yaml."""
    errors = exc.errors()
    # a typo of a required key shows as two errors, `missing` and `extra_forbidden`: the typo is the cause
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    return _located(first, where, data)


def field_errors(exc: ValidationError, model: Any, where: str = "", data: Any = None) -> list[ConfigError]:
    """Every problem of `exc`, one line each (`offload config check`). An unknown key says which allowed key of
    `model` at its place is closest ("did you mean 'bucket'?"), and that key's own `Field required` is left out:
    the typo is the one problem."""
    found: list[ConfigError] = []
    meant: set[tuple[str, ...]] = set()
    errors = exc.errors()
    for error in (e for e in errors if e["type"] == "extra_forbidden"):
        parent, key = _path(error["loc"][:-1], data), str(error["loc"][-1])
        near = closest(key, allowed_keys(model, parent, data))
        if near is not None:
            meant.add((*parent, near))
        found.append(ConfigError(f"{_located(error, where, data)}{did_you_mean(near)}"))
    for error in (e for e in errors if e["type"] != "extra_forbidden"):
        if error["type"] == "missing" and tuple(_path(error["loc"], data)) in meant:
            continue
        found.append(_located(error, where, data))
    return found


def _located(error: Any, where: str, data: Any) -> ConfigError:
    path = [where] if where else []
    path += _path(error["loc"], data)
    message = _message(error)
    if error["type"] == "unknown_kind":  # a discriminator's own error (see offload.storage.settings): name `kind`
        given = error["input"]
        if not isinstance(given, Mapping):
            message = f"must be a mapping of settings, got {type(given).__name__}"
        else:
            path.append("kind")
            got = given.get("kind")
            message = f"{message}, got {str(got)[:40]!r}" if got is not None else f"Field required, {message}"
    return ConfigError(f"{'.'.join(path) or 'config'}: {message}")


def allowed_keys(model: Any, path: Sequence[str], data: Any) -> set[str]:
    """The setting names `model` allows at `path` (a mapping's place in `data`), following dicts, lists, optional
    values and kinds (`kind: s3` picks the s3 model); empty where the place is no model."""
    node, value = model, data
    for part in path:
        node = _member(node, value)
        if isinstance(node, type) and issubclass(node, BaseModel) and part in node.model_fields:
            node = node.model_fields[part].annotation
        elif get_origin(node) is dict:
            node = get_args(node)[1]
        elif get_origin(node) is list and part.isdigit():
            node = get_args(node)[0]
        else:
            return set()
        value = value.get(part) if isinstance(value, Mapping) else None
    node = _member(node, value)
    return set(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else set()


def _member(node: Any, value: Any) -> Any:
    """The model a (possibly Annotated, Optional or union) type means for `value`: a union member by `kind`."""
    while get_origin(node) is Annotated:
        node = get_args(node)[0]
    if get_origin(node) not in (Union, UnionType):
        return node
    members = [_member(a, value) for a in get_args(node) if a is not type(None)]
    if len(members) == 1:
        return members[0]
    kind = value.get("kind", "local") if isinstance(value, Mapping) else None
    for member in members:
        field = member.model_fields.get("kind") if isinstance(member, type) and issubclass(member, BaseModel) else None
        if field is not None and field.default == kind:
            return member
    return None


def _path(loc: Sequence[int | str], data: Any) -> list[str]:
    parts: list[str] = []
    node = data
    for item in loc:
        if isinstance(item, str) and item.startswith(("function-", "tagged-union[")):
            continue  # a validator's own frame
        if isinstance(node, Mapping) and item not in node and item == node.get("kind", "local"):
            continue  # the tag of a discriminated union member, not a key
        parts.append(str(item))
        if isinstance(node, Mapping):
            node = node.get(item)
        elif isinstance(node, list) and isinstance(item, int) and 0 <= item < len(node):
            node = node[item]
        else:
            node = None
    return parts


def _message(error: Any) -> str:
    kind, ctx = error["type"], error.get("ctx", {})
    if kind == "missing":
        return "Field required"  # pydantic's words, which the API and the dashboard's forms show as well
    if kind == "extra_forbidden":
        return "unknown setting"
    if kind == "union_tag_invalid":
        return f"unknown kind {ctx.get('tag')!r} (known: {ctx.get('expected_tags')})"
    message = str(error["msg"])
    return message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
