"""Who a request comes from, for the limits that count per client address (failed authentication, requests
without a key).

The socket peer, unless it is one of the operator's `server.trusted_proxies` (CIDRs): then the forwarding header
that proxy wrote names the client. `X-Forwarded-For` is read (every proxy in common use appends the address it
saw to it), and `Forwarded` (RFC 7239) only when there is no `X-Forwarded-For`. Both are lists a client can start
itself, so the list is walked from the right, past the trusted proxies, and the first hop that is not one of
them is the client: what a client wrote to the left of that hop is never believed. Nothing is read from the
headers of a peer that is not a trusted proxy.

An IPv6 client is counted by its /64: one customer gets a /64 (or more) and can pick any address in it.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence

from offload.schema import Network

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
UNKNOWN = "unknown"
_FOR = re.compile(r'(?:^|[;,\s])for\s*=\s*("[^"]*"|[^;,\s]*)', re.IGNORECASE)


def _address(text: str) -> Address | None:
    """An address from a header hop: `1.2.3.4`, `1.2.3.4:5678`, `[2001:db8::1]:443`, `2001:db8::1`."""
    text = text.strip().strip('"')
    if text.startswith("["):
        text = text[1 : text.find("]")] if "]" in text else ""
    elif text.count(":") == 1:  # v4 with a port
        text = text.split(":", 1)[0]
    try:
        found = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(found, ipaddress.IPv6Address) and found.ipv4_mapped is not None:
        return found.ipv4_mapped
    return found


def _trusted(address: Address, networks: Sequence[Network]) -> bool:
    return any(address.version == n.version and address in n for n in networks)


def bucket(address: Address) -> str:
    """What a limit counts: an IPv4 address, or an IPv6 address's /64."""
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((int(address) >> 64 << 64, 64)))
    return str(address)


def _hops(headers: Iterable[tuple[bytes, bytes]]) -> list[str]:
    forwarded_for: list[str] = []
    forwarded: list[str] = []
    for name, value in headers:
        if name == b"x-forwarded-for":
            forwarded_for += value.decode("latin-1").split(",")
        elif name == b"forwarded":
            forwarded += [m[1] for m in _FOR.finditer(value.decode("latin-1"))]
    return forwarded_for or forwarded


def client_address(peer: str | None, headers: Iterable[tuple[bytes, bytes]], trusted: Sequence[Network]) -> str:
    """The client's bucket (see `bucket`): the socket peer's, or, for a trusted proxy, the right-most hop of its
    forwarding header that is not a trusted proxy. A hop that is not an address (`unknown`, an obfuscated name)
    ends the walk at the last address known."""
    address = _address(peer) if peer else None
    if address is None:
        return peer or UNKNOWN
    if not trusted or not _trusted(address, trusted):
        return bucket(address)
    for hop in reversed(_hops(headers)):
        found = _address(hop)
        if found is None:
            break
        address = found
        if not _trusted(found, trusted):
            break
    return bucket(address)
