"""Checks of the network environment a process group depends on, before anything waits on it.

* ``NCCL_SOCKET_IFNAME`` follows NCCL's rules: a comma list; a leading ``^`` makes the whole list an
  exclusion list; a leading ``=`` on an entry asks for an exact name; otherwise an entry is a *prefix*
  (``eth`` matches ``eth0`` and ``eth1``).
* ``GLOO_SOCKET_IFNAME`` follows gloo's rules as torch applies them: a comma list of *exact* interface names,
  one gloo device per name.
* ``MASTER_ADDR`` must resolve; resolution runs on a helper thread with a bound, so a dead DNS server
  cannot stall init.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence

__all__ = ["check_socket_ifname", "interfaces", "resolve_host"]


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


def resolve_host(host: str, timeout: float = 10.0) -> str | None:
    """Resolve ``host``; return None on success or the reason it failed (including a timeout)."""
    result: list[str | None] = []

    def work() -> None:
        try:
            socket.getaddrinfo(host, None)
            result.append(None)
        except (OSError, UnicodeError) as e:
            result.append(str(e) or type(e).__name__)

    thread = threading.Thread(target=work, name="robustdist-resolve", daemon=True)
    thread.start()
    thread.join(timeout)
    if not result:
        return f"name resolution did not answer within {timeout:g} s"
    return result[0]
