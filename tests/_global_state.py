"""What a test must leave as it found it in the pytest process, beyond the environment: the level, handlers,
``propagate`` and ``disabled`` flags of the root logger and of robustdist's loggers, and the process's signal
handlers (but those a library installs). A change leaks into the next test on the same xdist worker (a logger left
at INFO makes a later test's log assertions see what it did not expect).

Other libraries' loggers are left alone: torch, Ray and the frameworks configure theirs when first imported or
used, which is their set-up, not a test's leak (undoing it would make the next test see a library set up in a way
it never is)."""

from __future__ import annotations

import logging
import signal
from typing import Any

# Signals whose handlers code under test may install (and must restore); SIGALRM is pytest-timeout's.
_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP,
                             signal.SIGCHLD, signal.SIGPIPE) if s is not None)


def snapshot() -> dict[str, Any]:
    loggers: dict[str, tuple[int, tuple[logging.Handler, ...], bool, bool]] = {}
    for name, logger in [("", logging.getLogger()), *logging.Logger.manager.loggerDict.items()]:
        if isinstance(logger, logging.Logger) and (name in ("", "robustdist") or name.startswith("robustdist.")):
            loggers[name] = (logger.level, tuple(logger.handlers), logger.propagate, logger.disabled)
    return {"loggers": loggers, "signals": {s: signal.getsignal(s) for s in _SIGNALS}}


def _librarys(handler: Any) -> bool:
    """A handler a library installs on first use and keeps (torch's DataLoader: SIGCHLD; ``ray.init``: SIGTERM; a
    Ray Train fit: SIGINT): its set-up, made once per process, not a test's leak. A test's own handler or
    robustdist's counts."""
    module = getattr(handler, "__module__", None)
    return hasattr(handler, "__code__") and isinstance(module, str) and not module.startswith(("robustdist", "tests"))


def _capture_handler(handler: logging.Handler) -> bool:
    """pytest's own log capture handlers (``caplog``, the live-log and report handlers), which it adds and
    removes around each phase."""
    return type(handler).__module__.startswith("_pytest")


def restore(before: dict[str, Any]) -> list[str]:
    """Put back what changed since ``before``; return a description of each change (empty: nothing changed).
    Loggers created during the test are compared with a fresh logger's defaults (level NOTSET, no handlers)."""
    changes: list[str] = []
    after = snapshot()
    for name, (level, handlers, propagate, disabled) in after["loggers"].items():
        old = before["loggers"].get(name, (logging.NOTSET, (), True, False))
        own = tuple(h for h in handlers if not _capture_handler(h))
        old_own = tuple(h for h in old[1] if not _capture_handler(h))
        logger = logging.getLogger(name or None)
        label = f"logger {name!r}" if name else "the root logger"
        if level != old[0]:
            changes.append(f"{label}: level {logging.getLevelName(old[0])} -> {logging.getLevelName(level)}")
            logger.setLevel(old[0])
        if own != old_own:
            changes.append(f"{label}: handlers {list(old_own)} -> {list(own)}")
            for h in own:
                if h not in old_own:
                    logger.removeHandler(h)
            for h in old_own:
                if h not in own:
                    logger.addHandler(h)
        if propagate != old[2]:
            changes.append(f"{label}: propagate {old[2]} -> {propagate}")
            logger.propagate = old[2]
        if disabled != old[3]:
            changes.append(f"{label}: disabled {old[3]} -> {disabled}")
            logger.disabled = old[3]
    for sig, handler in before["signals"].items():
        now = after["signals"][sig]
        if now != handler and not (_librarys(handler) or _librarys(now)):
            changes.append(f"signal {signal.Signals(sig).name}: handler {handler!r} -> {now!r}")
            if handler is not None:
                signal.signal(sig, handler)
    return changes
