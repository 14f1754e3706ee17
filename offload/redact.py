"""The one redaction path for text that leaves a process: backend and provider error excerpts, autoscaler
events and alerts, job errors, log lines, URLs in messages.

Two layers, always both:
1. the secrets of the configuration the text came from (a backend's API key, a provider's credentials, the
   worker key shipped to a rented machine), replaced wherever they occur, in every form a URL or a JSON
   document may carry them (`_variants`: percent-encoded, once or twice, with either case of hex digit or `+`
   for a space; JSON-escaped, `\\/` or `\\u00xx`; base64, standard or URL-safe, padded or not) and, for
   `id:secret` pairs (fal), each half; offload's own webhook paths lose their secret in the same forms
   (`hook_paths`: fal carries the URL percent-encoded in a query string, a JSON body may escape its slashes);
2. anything shaped like a credential: URL userinfo (a password may itself contain `@`), query parameters
   named like a secret (`?password=`, `token`, `sig`, `X-Amz-Signature` ...), JSON or header fields named like
   one (`"token": "..."`, `"api_key"`, `Authorization: ...`), `Bearer`/`Basic` values and known key formats.

Layer 2 exists because a provider may echo a secret we never knew (its own session token, a signed URL);
layer 1 because a secret may have any shape. Redaction always runs before truncation, so a key cut at the
boundary cannot leak half of itself.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import Iterable
from urllib.parse import quote, quote_plus, urlsplit

REDACTED = "[REDACTED]"
MASK = "***"
EXCERPT_CHARS = 300
MIN_SECRET = 6  # shorter "secrets" (a port, "none") would blank out ordinary text

# scheme://userinfo@ : the userinfo runs to the LAST '@' before the path, so a password containing '@' is
# masked whole; its user part (before the first ':') is kept, a bare token (`https://TOKEN@host`) is not.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^\s/?#@]*(?:@[^\s/?#@]*)*)@(?=[^\s@]*(?:[/?#\s]|$))")
_SECRET_WORDS = (
    r"password|passwd|pwd|secret|token|api[_-]?key|apikey|access[_-]?key|private[_-]?key|signature|"
    r"credential|authorization"
)
# in a query string short names are common too (Azure's `sig`, `X-Amz-Credential`, `?key=`)
_QUERY_PARAM = re.compile(rf"(?i)([?&;][^=&\s#\"']*(?:{_SECRET_WORDS}|sig|key|auth)[^=&\s#\"']*=)[^&\s#\"']*")
_NAMED = re.compile(
    rf"(?i)([\"']?)([\w.-]*(?:{_SECRET_WORDS})[\w.-]*)\1(\s*[:=]\s*)"
    r"(\"(?:[^\"\\]|\\.)*\"|'[^']*'|[^\s\"',;}&]+)"
)
_SCHEME_TOKEN = re.compile(r"\b(Bearer|Basic|Token|Key)\s+(?=\S*\d)[A-Za-z0-9._~+/:=-]{8,}")
_KEY_SHAPES = re.compile(
    r"\b(?:sk-[A-Za-z0-9_-]{8,}|r8_[A-Za-z0-9]{8,}|rpa_[A-Za-z0-9]{8,}|whsec_[A-Za-z0-9+/=]{8,}"
    r"|ofk_[A-Za-z0-9]+_[A-Za-z0-9_-]{8,}|hf_[A-Za-z0-9]{8,}|gh[pousr]_[A-Za-z0-9]{8,}|AKIA[A-Z0-9]{12,})"
)
_SPACE = re.compile(r"\s+")
# offload's own webhook URLs carry a per-submission secret as their last path segment (routes_hooks.py); the
# path's slashes may be percent-encoded (once or twice: a URL in a query string) or JSON-escaped
_SLASH = r"(?:/|%2[fF]|%252[fF]|\\/|\\u002[fF])"
_SEGMENT = rf"(?:(?!{_SLASH})(?:\\u[0-9a-fA-F]{{4}}|[^/\s?#&\"'\\]))+"
_HOOK_PATH = re.compile(rf"({_SLASH}v1{_SLASH}hooks{_SLASH}{_SEGMENT}{_SLASH}{_SEGMENT}{_SLASH}\d+{_SLASH}){_SEGMENT}")


def _json_escaped(text: str) -> set[str]:
    """`text` inside a JSON string as encoders write it: the minimal escapes, `/` as `\\/`, or everything but
    letters and digits as `\\u00xx` (either case of hex digit)."""
    minimal = json.dumps(text)[1:-1]
    lower = "".join(c if c.isalnum() and c.isascii() else f"\\u{ord(c):04x}" for c in text)
    upper = "".join(c if c.isalnum() and c.isascii() else f"\\u{ord(c):04X}" for c in text)
    return {minimal, minimal.replace("/", "\\/"), json.dumps(text, ensure_ascii=False)[1:-1], lower, upper}


def _encoded(text: str) -> set[str]:
    """`text` percent-encoded as URLs carry it: fully or keeping `/`, `+` for a space, either case of hex digit,
    and once more (a URL inside a query string)."""
    once = {quote(text, safe=""), quote(text), quote_plus(text)}
    once |= {re.sub(r"%[0-9A-F]{2}", lambda m: m[0].lower(), e) for e in once}
    return once | {quote(e, safe="") for e in once}


def _base64(text: str) -> set[str]:
    """`text` base64-encoded on its own (standard and URL-safe alphabets, padded or not)."""
    raw = text.encode()
    forms = {base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()}
    return forms | {f.rstrip("=") for f in forms}


@functools.lru_cache(maxsize=1024)  # a process knows a few secrets; each text is redacted against all of them
def _variants(secret: str) -> frozenset[str]:
    parts = {p for p in (secret, *secret.split(":")) if len(p) >= MIN_SECRET}  # fal keys are `id:secret`
    forms = set(parts)
    for p in parts:
        forms |= _encoded(p) | _json_escaped(p) | _base64(p)
    return frozenset(forms)


def _named(m: re.Match[str]) -> str:
    value = m[4]
    if value.startswith(REDACTED) or value.startswith(MASK):
        return m[0]
    quote_char = value[0] if value[:1] in ("'", '"') else ""
    return f"{m[1]}{m[2]}{m[1]}{m[3]}{quote_char}{REDACTED}{quote_char}"


def mask_url(url: str) -> str:
    """`url` with the password of its userinfo and any secret-named query parameter replaced by `***`."""
    out = _USERINFO.sub(_mask_userinfo, url)
    return _QUERY_PARAM.sub(lambda m: m[1] + MASK, out)


def _mask_userinfo(m: re.Match[str]) -> str:
    user, sep, _ = m[2].partition(":")
    return f"{m[1]}{user}:{MASK}@" if sep else f"{m[1]}{MASK}@"


def bare_url(url: str) -> str:
    """scheme://host[:port]/path only: for URLs whose query or userinfo is nobody's business (a redirect's
    Location, a provider's signed file URL)."""
    try:
        p = urlsplit(url)
        return f"{p.scheme}://{p.hostname}{f':{p.port}' if p.port else ''}{p.path}"
    except ValueError:
        return "<unparseable URL>"


def url_host(url: str | None) -> str | None:
    """host[:port] only: for a URL whose path and query may carry a token (a producer's callback URL on a page
    every viewer key reads). None for none or an unparseable one."""
    try:
        p = urlsplit(url or "")
        if not p.hostname:
            return None
        host = f"[{p.hostname}]" if ":" in p.hostname else p.hostname
        return f"{host}:{p.port}" if p.port else host
    except ValueError:  # a bad port
        return None


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """`text` with the given secrets and anything shaped like a credential replaced."""
    for secret in sorted({v for s in secrets if s for v in _variants(str(s))}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    text = mask_url(text)
    text = hook_paths(text)
    text = _SCHEME_TOKEN.sub(lambda m: f"{m[1]} {REDACTED}", text)
    text = _NAMED.sub(_named, text)
    return _KEY_SHAPES.sub(REDACTED, text)


def hook_paths(text: str) -> str:
    """`text` with the secret of every offload webhook path in it replaced (access logs, echoed URLs)."""
    return _HOOK_PATH.sub(lambda m: m[1] + REDACTED, text)


def excerpt(text: str, secrets: Iterable[str | None] = (), limit: int = EXCERPT_CHARS) -> str:
    """A short, single-line, redacted piece of a response body or message."""
    flat = _SPACE.sub(" ", redact(text, secrets)).strip()
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


class Redactor:
    """The secrets one process knows about (fed as configurations are loaded), applied to everything it writes
    where others can read it: autoscaler events, alerts and instance reasons."""

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        self.secrets: set[str] = {s for s in secrets if s}

    def add(self, *secrets: str | None) -> None:
        self.secrets.update(s for s in secrets if s)

    def __call__(self, text: str) -> str:
        return redact(text, self.secrets)
