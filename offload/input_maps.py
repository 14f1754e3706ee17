"""A per-backend input mapping (`inputs:` of a queue in offload.yaml): a function named `module:function`
(`imported`), or a template (`Template`).

A template is written as data (`inputs: {fal: {template: ...}}`): the backend's input as JSON, where an object
`{"$input": "path"}` stands for the job input's value at that dotted path (`prompt`, `image.url`, `images.0`; `.`
the whole input), `{"$input": "path", "default": v}` for it or `v` when missing. Nothing else is interpreted: no
expressions, no code, no string interpolation, so a template cannot do more than copy values
(docs/how-to/routing.md, *Input templates*).

Checked at config load (`check`, each problem naming its place in the template); a job input without a field
the template needs raises `MissingInput`, which fails that job (its dead-letter reason), never the worker.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterator
from typing import Any

from offload.errors import WorkerError

PLACEHOLDER = "$input"
DEFAULT = "default"
WHOLE = "."
_SEGMENT = re.compile(r"[A-Za-z0-9_-]+")
_MISSING = object()


class MissingInput(WorkerError, LookupError):
    """The job input lacks a field the template copies (and the placeholder has no default)."""


def check(template: Any, where: str = "") -> Iterator[str]:
    """Each problem of `template`, as `<where>.<place>: <what>` (the place inside the template, `.` its top);
    nothing for a valid one."""
    if isinstance(template, dict):
        if PLACEHOLDER in template:
            yield from _check_placeholder(template, where)
            return
        for key, value in template.items():
            if not isinstance(key, str):
                yield f"{where or '.'}: keys must be strings, got {key!r}"
            yield from check(value, _join(where, str(key)))
    elif isinstance(template, list):
        for i, value in enumerate(template):
            yield from check(value, f"{where}[{i}]")
    elif not (template is None or isinstance(template, str | int | float | bool)):
        yield f"{where or '.'}: must be JSON (an object, a list, a string, a number, true, false or null)"


def _check_placeholder(spec: dict[Any, Any], where: str) -> Iterator[str]:
    extra = sorted(str(k) for k in spec if k not in (PLACEHOLDER, DEFAULT))
    if extra:
        yield f"{where or '.'}: a {{{PLACEHOLDER!r}: path}} placeholder takes only 'default' beside it, got {extra}"
    path = spec[PLACEHOLDER]
    if not isinstance(path, str) or not (path == WHOLE or all(_SEGMENT.fullmatch(p) for p in path.split("."))):
        shown = _join(where, PLACEHOLDER)
        yield f"{shown}: must be a dotted path into the job input (prompt, image.url, or . for all of it), got {path!r}"
    if DEFAULT in spec:
        yield from check(spec[DEFAULT], _join(where, DEFAULT))


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


class Template:
    """A checked template, callable as an input mapping: `Template(spec)(job_input)` is the backend's input."""

    def __init__(self, spec: Any) -> None:
        if problem := next(check(spec), None):
            raise ValueError(problem)
        self.spec = spec

    def __call__(self, job_input: Any) -> Any:
        return _render(self.spec, job_input, "")

    def __repr__(self) -> str:
        return f"Template({self.spec!r})"


def _render(spec: Any, job_input: Any, where: str) -> Any:
    if isinstance(spec, dict):
        if PLACEHOLDER in spec:
            return _lookup(job_input, spec, where)
        return {key: _render(value, job_input, _join(where, key)) for key, value in spec.items()}
    if isinstance(spec, list):
        return [_render(value, job_input, f"{where}[{i}]") for i, value in enumerate(spec)]
    return spec


def _lookup(job_input: Any, spec: dict[str, Any], where: str) -> Any:
    path: str = spec[PLACEHOLDER]
    value = job_input if path == WHOLE else _at(job_input, path.split("."))
    if value is not _MISSING:
        return value
    if DEFAULT in spec:
        return _render(spec[DEFAULT], job_input, _join(where, DEFAULT))
    raise MissingInput(f"the job input has no {path!r} (the template's {where or '.'} needs it)")


def _at(value: Any, parts: list[str]) -> Any:
    for part in parts:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
    return value


def imported(path: str) -> Callable[[Any], Any]:
    """The function `module:function` names, imported from this process's Python path; a ValueError says why
    not (offload.config names the field)."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"must look like module:function (e.g. mypkg.maps:to_fal), got {path!r}")
    try:
        found = importlib.import_module(module)
    except Exception as exc:  # an import error of the user's module, whatever it is, is a config problem
        raise ValueError(f"cannot import {module!r}: {type(exc).__name__}: {exc}") from None
    fn: Any = found
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ValueError(f"{path!r}: module {module!r} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]
