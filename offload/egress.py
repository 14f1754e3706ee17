"""Where a fetch of a URL that someone else named may connect: the one rule for every outbound request whose URL
came from a provider's answer or a job's input (the dispatch worker's copy of output files, offload.storage.outputs).

Outputs often echo their input, so such a URL is the producer's choice, not the provider's. Fetched unchecked, it
reaches whatever the worker can reach (a cloud metadata service, Redis, an internal admin page) and its bytes land
in the producer's results. So:

- The address is checked at the socket, on the address actually connected to (aiohttp's `socket_factory`, after
  its own DNS resolution): a name that resolves to a public address once and to 127.0.0.1 the next time (DNS
  rebinding) is checked again at that connect, and an IP literal in any spelling is judged as the address it is.
  Every redirect hop is a new request, so it is checked the same way.
- `Reach.PUBLIC` (the default): globally routable unicast addresses only. Loopback, RFC 1918, CGNAT (100.64/10),
  link-local, ULA, unspecified, multicast, reserved and documentation ranges are refused, and the IPv6 forms that
  carry an IPv4 address (v4-mapped `::ffff:a.b.c.d`, v4-compatible `::a.b.c.d`, NAT64 `64:ff9b::/96`, 6to4) are
  judged by the address they carry.
- `Reach.LOCAL` (a backend's own origin, or its `allow_private_hosts: true`): loopback, RFC 1918, CGNAT and ULA
  addresses too, for a local stack or a self-hosted provider. Never link-local, unspecified, multicast or a cloud
  metadata address, whatever the settings.
- A backend's `file_hosts` names the only hosts its copies may fetch from, every redirect hop included.

Every refusal is the same `AddressRefused` with the same text (what a producer may see of it is one generic line,
offload.storage.outputs); which address and why is in its attributes, for the operator's log.
"""

from __future__ import annotations

import enum
import errno
import socket
from collections.abc import Callable, Collection
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network
from typing import Any
from urllib.parse import urlsplit

from offload.errors import ObjectStoreError

POLICY = "offload.egress"  # the httpx request extension that carries a fetch's FilePolicy to the transport
REFUSED = "refused by the egress rule"
_METADATA = frozenset(ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200", "192.0.0.192"))
_LOCAL = tuple(
    ip_network(n) for n in ("127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")
) + tuple(ip_network(n) for n in ("::1/128", "fc00::/7"))
_GLOBAL_V6 = ip_network("2000::/3")
_NAT64 = ip_network("64:ff9b::/96")
_DEFAULT_PORTS = {"http": 80, "https": 443}
_NEVER = (("is_link_local", "a link-local"), ("is_unspecified", "an unspecified"), ("is_multicast", "a multicast"))

AddrInfo = tuple[int, int, int, str, tuple[Any, ...]]


class Reach(enum.Enum):
    PUBLIC = "public"
    LOCAL = "local"


class AddressRefused(ObjectStoreError, PermissionError):
    """A connection (or a redirect hop) the egress rule refuses. One text for every refusal, so that several at
    once (a name with an IPv4 and an IPv6 address) collapse into one; `address` and `why` say which and why."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(errno.EACCES, REFUSED)
        self.address, self.why = address, why


def carried(ip: IPv4Address | IPv6Address) -> IPv4Address | IPv6Address:
    """The IPv4 address an IPv6 form carries (v4-mapped, NAT64, 6to4, v4-compatible), else `ip` itself."""
    if isinstance(ip, IPv4Address):
        return ip
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64 or (int(ip) >> 32 == 0 and int(ip) > 1):  # `::a.b.c.d`, never `::` or `::1`
        return IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


def refusal(host: str, reach: Reach) -> str | None:
    """Why a connection to the address `host` is refused at `reach`; None when it may go ahead."""
    try:
        ip = ip_address(host)
    except ValueError:
        return "not an IP address"
    inner = carried(ip)
    if ip in _METADATA or inner in _METADATA:
        return "a cloud metadata address"
    for flag, what in _NEVER:
        if getattr(inner, flag):
            return f"{what} address"
    if isinstance(inner, IPv4Address) and inner.is_global:
        return None
    if isinstance(inner, IPv6Address) and inner in _GLOBAL_V6 and inner.is_global:
        return None
    if reach is Reach.LOCAL and any(inner in net for net in _LOCAL):
        return None
    return "a loopback or private address" if any(inner in net for net in _LOCAL) else "not a public address"


def socket_factory(reach: Reach) -> Callable[[AddrInfo], socket.socket]:
    """aiohttp's `socket_factory` for a connector whose every connection obeys `reach`: called with the address
    the socket is about to connect to, after name resolution."""

    def make(addr_info: AddrInfo) -> socket.socket:
        family, kind, proto, _, address = addr_info
        host = str(address[0])
        if (why := refusal(host, reach)) is not None:
            raise AddressRefused(host, why)
        return socket.socket(family=family, type=kind, proto=proto)

    return make


def origin(url: str) -> str | None:
    """`scheme://host:port`, the port always given; None for anything but an http(s) URL with a host."""
    try:
        parts = urlsplit(url)
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme.lower())
    except ValueError:
        return None
    host = (parts.hostname or "").lower()
    if not host or port is None:
        return None
    return f"{parts.scheme.lower()}://{host}:{port}"


@dataclass(frozen=True)
class FilePolicy:
    """What one backend's output-file copies may fetch: `allow_private` (backends.<name>.allow_private_hosts),
    the operator's own origins (the backend's `base_url`, the result store's endpoint: the operator named them,
    so their files are fetched at LOCAL reach), and `hosts` (backends.<name>.file_hosts: exact hosts, or
    `.suffix` entries; None: any host)."""

    allow_private: bool = False
    own_origins: frozenset[str] = frozenset()
    hosts: tuple[str, ...] | None = None

    @classmethod
    def of(cls, *own: str, allow_private: bool = False, hosts: Collection[str] | None = None) -> FilePolicy:
        """The policy whose own origins are those of the URLs `own` (a backend's base_url, the result store's)."""
        origins = frozenset(o for o in map(origin, own) if o is not None)
        return cls(allow_private, origins, None if hosts is None else tuple(h.lower() for h in hosts))

    def listed(self, host: str) -> bool:
        host = host.lower().strip("[]")
        if self.hosts is None:
            return bool(host)
        return any(host == e.lstrip(".") or (e.startswith(".") and host.endswith(e)) for e in self.hosts)

    def reach(self, scheme: str, host: str, port: int | None) -> Reach:
        """The reach of one request, from the URL exactly as the transport connects to it."""
        if self.allow_private:
            return Reach.LOCAL
        port = port or _DEFAULT_PORTS.get(scheme.lower())
        here = f"{scheme.lower()}://{host.lower().strip('[]')}:{port}"
        return Reach.LOCAL if here in self.own_origins else Reach.PUBLIC

    def check(self, scheme: str, host: str, port: int | None) -> Reach:
        """The request's reach, or AddressRefused for a host `file_hosts` does not name."""
        if not self.listed(host):
            raise AddressRefused(host, "not on the backend's file_hosts")
        return self.reach(scheme, host, port)


def enforced(client: Any) -> bool:
    """Whether an httpx client's transport applies this rule to every connection (`new_client(egress=True)`)."""
    return bool(getattr(getattr(client, "_transport", None), "enforces_egress", False))


MAX_URL_CHARS = 2048  # a callback URL is kept on every job record that names one


def url_problem(url: object) -> str | None:
    """Why `url` cannot be a URL offload sends requests to on someone's behalf (a completion webhook's), in a few
    words; None when it can: http or https, a host, no credentials in it (they would sit in job records), no
    fragment, at most MAX_URL_CHARS printable characters. Where its host may be is the caller's rule."""
    if not isinstance(url, str) or not url:
        return "must be a non-empty string"
    if len(url) > MAX_URL_CHARS:
        return f"is {len(url)} characters, over the limit of {MAX_URL_CHARS}"
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        return "must not contain spaces or control characters"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError as exc:
        return f"is not a valid URL ({exc})"
    if parts.scheme.lower() not in _DEFAULT_PORTS:
        return f"must be an http:// or https:// URL, got scheme {parts.scheme or 'none'!r}"
    if not parts.hostname:
        return "must name a host"
    if "@" in parts.netloc:
        return "must not carry credentials (user:password@)"
    if parts.fragment:
        return "must not have a #fragment"
    return None
