"""Files by reference: `File(...)` values in a job's input or a handler's output, and the references that replace them.

A job input lives in Redis and is at most 1 MiB; a 40 MB audio file does not belong there. A producer puts
`File("talk.mp3")` anywhere in the input instead, the client streams it to object storage, and the job carries a
small reference in its place:

    {"$file": "results/gpu:_in/<hex>/0-talk.mp3", "size": 40123456, "sha256": "...", "content_type": "audio/mpeg"}

The reference is plain JSON, so it survives Redis, the HTTP API and every language. This module only knows the
shapes (what a `File` is, what a reference is, how to find and replace them anywhere in a JSON value); the
uploads, presigned URLs and clean-up are in `offload.storage.inputs`.
"""

from __future__ import annotations

import contextlib
import io
import mimetypes
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, cast

import orjson

from offload.errors import RequestError

REF_KEY = "$file"
DEFAULT_MAX_FILE_BYTES = 5 * 1024**3  # storage.max_input_file_bytes unless set: S3's single-PUT limit
REF_FIELDS = frozenset({REF_KEY, "size", "sha256", "content_type", "name"})
# A reference's key in JSON text as offload writes it (orjson, or json.dumps): `$` is never escaped there, and a
# quote inside a string always is, so `"$file"` after `{` or `,` and before `:` is an object's key.
REF_MARKER = b'"$file"'
# a `"$file"` member name (after `{` or `,`: never inside a string, where its quotes would be escaped) and its value
_REF_SCAN = re.compile(rb'[{,]\s*"\$file"\s*:\s*("[^"\\]*(?:\\.[^"\\]*)*")')
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
Path_ = tuple[str | int, ...]


class File:
    """A file to send by reference: a path, bytes, or a readable binary file object (read from its current
    position to EOF, never as a whole into memory; the caller keeps ownership and closes it)."""

    def __init__(
        self,
        source: str | os.PathLike[str] | bytes | bytearray | memoryview | IO[bytes],
        name: str | None = None,
        content_type: str | None = None,
    ) -> None:
        if isinstance(source, str | os.PathLike):
            self.path: Path | None = Path(source)
            self._data: bytes | None = None
            self._fileobj: IO[bytes] | None = None
            default_name = self.path.name
        elif isinstance(source, bytes | bytearray | memoryview):
            self.path, self._data, self._fileobj = None, bytes(source), None
            default_name = "file"
        elif callable(getattr(source, "read", None)):
            self.path, self._data, self._fileobj = None, None, source
            default_name = Path(str(getattr(source, "name", "") or "file")).name
        else:
            raise TypeError(f"File() takes a path, bytes or a binary file object, got {type(source).__name__}")
        self.name = name or default_name or "file"
        self.content_type = content_type or mimetypes.guess_type(self.name)[0] or "application/octet-stream"

    def __repr__(self) -> str:
        where = str(self.path) if self.path else "<bytes>" if self._data is not None else "<file object>"
        return f"File({where!r}, name={self.name!r}, content_type={self.content_type!r})"

    def open(self) -> IO[bytes]:
        """A readable stream of the content. A path that cannot be read raises `FileUnreadable` naming it."""
        if self.path is not None:
            try:
                if not self.path.is_file():
                    raise FileUnreadable(f"{self.path}: not a readable file (missing, or a directory)")
                return self.path.open("rb")
            except OSError as exc:
                raise FileUnreadable(f"{self.path}: cannot be read: {exc.strerror or exc}") from None
        if self._data is not None:
            return io.BytesIO(self._data)
        assert self._fileobj is not None
        return cast(IO[bytes], _Borrowed(self._fileobj))

    def size_hint(self) -> int | None:
        """The size when it is known without reading (a path, bytes); None for a stream."""
        if self.path is not None:
            try:
                return self.path.stat().st_size
            except OSError:
                return None
        return len(self._data) if self._data is not None else None


class FileUnreadable(RequestError, ValueError):
    """A `File` whose source cannot be read: the message names the path and why."""


class _Borrowed(io.RawIOBase):
    """The caller's file object, read through but never closed by us."""

    def __init__(self, inner: IO[bytes]) -> None:
        self._inner = inner

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return self._inner.read(size)

    def readinto(self, buffer: Any) -> int:
        data = self._inner.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def safe_name(name: str) -> str:
    """A file name that is safe in any object store and file system (letters, digits, `._-`, at most 100)."""
    base = _UNSAFE.sub("_", Path(name).name).strip("._")[-100:]
    return base or "file"


def reference(key: str, size: int, sha256: str, content_type: str) -> dict[str, Any]:
    return {REF_KEY: key, "size": size, "sha256": sha256, "content_type": content_type}


def is_reference(value: Any) -> bool:
    """A mapping with a string `$file` key (the other fields are checked by `reference_problem`)."""
    return isinstance(value, Mapping) and isinstance(value.get(REF_KEY), str)


def reference_problem(value: Mapping[str, Any]) -> str | None:
    """Why `value` is not a well-formed reference (None: it is)."""
    extra = set(value) - REF_FIELDS
    if extra:
        return f"unknown field(s) {', '.join(sorted(extra))} in a file reference"
    size = value.get("size")
    if size is not None and (type(size) is not int or size < 0):
        return "size must be a non-negative integer"
    digest = value.get("sha256")
    if digest is not None and (not isinstance(digest, str) or not _SHA256.match(digest)):
        return "sha256 must be 64 lowercase hex digits"
    content_type = value.get("content_type")
    if content_type is not None and not isinstance(content_type, str):
        return "content_type must be a string"
    return None


def walk(value: Any, path: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    """Every `File` and every reference in a JSON-like value, with its path; references are not descended."""
    if isinstance(value, File) or is_reference(value):
        yield path, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from walk(v, (*path, str(k)))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from walk(v, (*path, i))


def may_hold_references(encoded: bytes) -> bool:
    """False when JSON text offload wrote holds no reference: one byte search instead of a walk of the value."""
    return REF_MARKER in encoded


def reference_keys(encoded: bytes) -> list[str]:
    """The distinct `$file` strings of JSON text offload wrote, in order, found by byte search without parsing
    the rest: every reference's key (and those nested in a reference's own fields, which the walk skips). One
    regex pass in C, and each distinct string decoded once, so a reference repeated many times costs what one
    does (docs/explanation/performance.md, *File references*)."""
    keys: dict[str, None] = {}
    for raw in dict.fromkeys(_REF_SCAN.findall(encoded)):
        with contextlib.suppress(ValueError):  # not a string any JSON encoder writes
            keys.setdefault(orjson.loads(raw), None)
    return list(keys)


def find_references(value: Any, max_distinct: int | None = None) -> list[tuple[Path_, dict[str, Any]]]:
    """`references_in` in one iterative pass: no generator per node, and no path built but a reference's.
    Raises `TooManyReferences` once more than `max_distinct` different keys were seen."""
    if is_reference(value):
        return [((), dict(value))]
    found: list[tuple[Path_, dict[str, Any]]] = []
    distinct: set[str] = set()
    path: list[str | int] = []
    frames: list[Iterator[tuple[Any, Any]]] = [_children(value)]
    in_mapping = [isinstance(value, Mapping)]
    while frames:
        for key, child in frames[-1]:
            kind = type(child)
            if kind in _LEAVES or not child:
                continue
            mapping = kind is dict or (kind is not list and isinstance(child, Mapping))
            if mapping and isinstance(ref := child.get(REF_KEY), str):
                found.append(((*path, str(key) if in_mapping[-1] else key), dict(child)))
                distinct.add(ref)
                if max_distinct is not None and len(distinct) > max_distinct:
                    raise TooManyReferences(max_distinct)
                continue
            if not mapping and not isinstance(child, list | tuple):
                continue
            path.append(str(key) if in_mapping[-1] else key)
            frames.append(_children(child))
            in_mapping.append(mapping)
            break
        else:
            frames.pop()
            in_mapping.pop()
            if path:
                path.pop()
    return found


_LEAVES = frozenset({int, float, str, bool, type(None)})


def _children(value: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(value, Mapping):
        return iter(value.items())
    if isinstance(value, list | tuple):
        return enumerate(value)
    return iter(())


class TooManyReferences(RequestError, ValueError):
    """More distinct file references than a limit allows (`find_references`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"more than {limit} distinct file references")
        self.limit = limit


def files_in(value: Any) -> list[tuple[Path_, File]]:
    return [(p, v) for p, v in walk(value) if isinstance(v, File)]


def references_in(value: Any) -> list[tuple[Path_, dict[str, Any]]]:
    return [(p, dict(v)) for p, v in walk(value) if not isinstance(v, File)]


def replace(value: Any, fn: Callable[[Any], Any]) -> Any:
    """A copy of `value` with every `File` and every reference `v` replaced by `fn(v)`; the input is untouched."""
    if isinstance(value, File) or is_reference(value):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: replace(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [replace(v, fn) for v in value]
    return value


def field_name(path: Path_, root: str = "input") -> str:
    """`("audio", 0)` -> `input.audio[0]`: how errors name the field that holds a bad file."""
    out = root
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out
