"""What ``robustdist run``'s agent and its workers say to each other (issue #35): environment variables and one key
in the agent's store. The standard library only: both sides import it (the launcher and :mod:`robustdist.recovery`
are peers)."""

from __future__ import annotations

__all__ = ["REPLACES_ENV", "RUN_ENV", "STATE_KEY"]

RUN_ENV = "ROBUSTDIST_RUN"
"""Set to ``"1"`` by ``robustdist run`` for its workers: rank 0 then publishes its in-process recovery state."""

REPLACES_ENV = "ROBUSTDIST_REPLACES"
"""Set for a worker the agent started in place of a dead one: JSON ``{"rank", "pid", "died", "n"}`` (the global
rank, the dead process's pid, how it died, and the how-manyth replacement of this agent this is)."""

STATE_KEY = "robustdist/launcher/state"
"""In the agent's store (the job's lifetime): rank 0's current in-process recovery generation, as JSON
(:func:`robustdist.recovery.replacement.publish`). Present only while a run that can take a replacement trains:
the agent replaces a dead worker only then."""
