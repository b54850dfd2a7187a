"""Checks of the network environment a process group depends on, before anything waits on it.

* ``NCCL_SOCKET_IFNAME`` follows NCCL's rules: a comma list; a leading ``^`` makes the whole list an
  exclusion list; a leading ``=`` on an entry asks for an exact name; otherwise an entry is a *prefix*
  (``eth`` matches ``eth0`` and ``eth1``).
* ``GLOO_SOCKET_IFNAME`` follows gloo's rules as torch applies them: a comma list of *exact* interface names,
  one gloo device per name.
* ``MASTER_ADDR`` must resolve; resolution runs on a helper thread with a bound, so a dead DNS server
  cannot stall init. :func:`resolve_addresses` also says what it resolved to, and :func:`local_only` tells a
  loopback (or unspecified) address, which other nodes cannot reach, from a routable one.
* :func:`probe` tells, with one bounded plain-socket connect, why a port did not give a c10d store: nothing
  listens (refused), nothing answers (unreachable or filtered), or something answered that is not a store.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Sequence

from robustdist.runtime.deadline import bounded

__all__ = ["check_socket_ifname", "interfaces", "local_only", "probe", "resolve_addresses", "resolve_host"]


def interfaces() -> list[str]:
    """Names of this host's network interfaces."""
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def _nccl_matches(spec: str, names: Sequence[str]) -> list[str]:
    exclude = spec.startswith("^")
    entries = [e.strip() for e in (spec[1:] if exclude else spec).split(",") if e.strip()]

    def hit(entry: str, name: str) -> bool:
        return name == entry[1:] if entry.startswith("=") else name.startswith(entry)

    if exclude:
        return [n for n in names if not any(hit(e, n) for e in entries)]
    return [n for n in names if any(hit(e, n) for e in entries)]


def check_socket_ifname(var: str, value: str | None, names: Sequence[str] | None = None) -> str | None:
    """Return a problem description (with the interfaces that exist and the fix) or None if ``value`` is fine.

    Args:
        var: ``"NCCL_SOCKET_IFNAME"`` or ``"GLOO_SOCKET_IFNAME"`` (they follow different rules).
        value: the variable's value; None or empty means unset, which is fine.
        names: the interfaces to check against (default: this host's).
    """
    if not value:
        return None
    names = list(interfaces() if names is None else names)
    existing = ", ".join(names) or "none found"
    if var == "GLOO_SOCKET_IFNAME":
        missing = [e.strip() for e in value.split(",") if e.strip() and e.strip() not in names]
        if not missing and value.strip(","):
            return None
        return (f"GLOO_SOCKET_IFNAME={value!r} names interface(s) {', '.join(missing) or repr(value)} that do not exist "
                f"on {socket.gethostname()}; expected exact names from this host's interfaces: {existing}. "
                "Fix: set GLOO_SOCKET_IFNAME to one of them (gloo wants exact names, comma-separated) or unset it.")
    if _nccl_matches(value, names):
        return None
    rule = ("excludes every interface" if value.startswith("^")
            else "matches no interface (entries are prefixes; '=name' is exact)")
    return (f"{var}={value!r} {rule} on {socket.gethostname()}; interfaces here: {existing}. "
            f"Fix: set {var} to a prefix of the interface that reaches the other nodes (e.g. {names[-1] if names else 'eth'}), "
            "or unset it.")


def resolve_addresses(host: str, timeout: float = 10.0) -> tuple[list[str], str | None]:
    """The distinct addresses ``host`` resolves to, in resolver order, and None; or ``([], reason)``."""

    def work() -> tuple[list[str], str | None]:
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
            return list(dict.fromkeys(str(info[4][0]) for info in infos)), None
        except (OSError, UnicodeError) as e:
            return [], str(e) or type(e).__name__

    found, error, finished = bounded(work, time.monotonic() + timeout, "resolve")
    if not finished:
        return [], f"name resolution did not answer within {timeout:g} s"
    if error is not None:
        return [], f"{type(error).__name__}: {error}"
    return found


def resolve_host(host: str, timeout: float = 10.0) -> str | None:
    """Resolve ``host``; return None on success or the reason it failed (including a timeout)."""
    return resolve_addresses(host, timeout)[1]


def local_only(address: str) -> bool:
    """True for an address no other machine can reach this one by: loopback (``127.0.0.0/8``, ``::1``, also
    IPv4-mapped) or unspecified (``0.0.0.0``, ``::``). False for anything else, including a hostname."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def probe(host: str, port: int, timeout: float = 1.0, *, listen: bool = True) -> tuple[str, str]:
    """Connect once to ``host:port`` with a plain socket, send nothing, and say what happened (with
    ``listen=False``, an accepted connection is closed at once, without waiting to see whether it speaks).

    Returns ``(kind, detail)``, ``kind`` being one of ``"refused"`` (nothing listens), ``"unreachable"`` (no route,
    or the address belongs to no machine), ``"no-answer"`` (the connect was not answered within ``timeout``:
    packets dropped), ``"accepted"`` (something accepted the connection and said nothing, as a c10d store also
    does) or ``"spoke"`` (it sent bytes unasked, or closed the connection: no c10d store does either).
    ``detail`` says it in words. Never raises and never waits much longer than ``timeout``.
    """
    start = time.monotonic()
    try:
        conn = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        return "refused", "connection refused"
    except (socket.timeout, TimeoutError):
        return "no-answer", f"no answer to a TCP connect within {timeout:g} s"
    except (OSError, UnicodeError, OverflowError, ValueError) as e:
        return "unreachable", (getattr(e, "strerror", None) or str(e) or type(e).__name__)
    with conn:
        if not listen:
            return "accepted", "it accepted the connection"
        conn.settimeout(max(0.05, min(0.5, timeout - (time.monotonic() - start))))
        try:
            data = conn.recv(48)
        except (socket.timeout, TimeoutError):
            return "accepted", "it accepted the connection and sent nothing"
        except OSError as e:
            return "spoke", f"it accepted the connection, then {e.strerror or e}"
    if not data:
        return "spoke", "it accepted the connection and closed it"
    return "spoke", f"it accepted the connection and sent {data!r}"
