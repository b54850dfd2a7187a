"""``robustdist run``: torchrun with an agent that replaces a killed worker alone.

Every torchrun flag is torchrun's own: the command line is parsed by ``torch.distributed.run``'s parser and the job is
launched by its ``run`` (rendezvous, ``--max-restarts``, ``--nnodes``, ``--rdzv_*``, logs and error files alike);
only the agent differs (:class:`robustdist.launcher.agent.Replacer`). Without in-process recovery in the training
script, or when the agent itself dies, it behaves exactly as torchrun, but for two things: the agent wakes at a
worker's end instead of at its next ``--monitor-interval`` look (:mod:`.deaths`); and without ``--log-dir``, torchrun
leaves its temporary ``torchelastic_*`` directory behind, which ``robustdist run`` removes at the end unless a file
was written there (a failed worker's error file, a redirected log). The launcher's own process sets
:data:`~robustdist.runtime.replacing.RUN_ENV` for its workers.

Its agent holds more open files than torchrun's (the attempt's store, the warm spare's pipes, a pidfd per worker:
about 40 where torchrun's holds 25, with 2 to 4 workers). Under an open-file limit (``ulimit -n``) below
:func:`descriptors_needed` it says so and runs exactly as torchrun, whose agent fits where this one may not.
"""

from __future__ import annotations

import logging
import os
import resource
import tempfile
from collections.abc import Sequence

from robustdist.runtime import _elastic_compat
from robustdist.runtime.log import logging_configured
from robustdist.runtime.replacing import RUN_ENV

__all__ = ["descriptors_needed", "main"]

log = logging.getLogger(__name__)  # the launcher is no rank: no rank prefix


def descriptors_needed(nproc_per_node: str, nnodes: str = "1") -> tuple[int, int, int]:
    """``(limit, local workers, nodes at most)``: the open-file limit under which ``robustdist run``'s agent runs as
    torchrun's, 64 plus 4 per local worker plus one per worker of the job (node 0's agent serves the attempt's store,
    which every worker connects to), above the ~40 it holds with 2 to 4 workers. ``--nproc-per-node`` and
    ``--nnodes`` as torchrun reads them (``cpu``, ``auto``: this host's count; 8 where torchrun cannot tell either)."""
    from torch.distributed import run as torch_run

    try:
        local = int(torch_run.determine_local_world_size(nproc_per_node))
    except Exception:  # torchrun itself then names the bad value
        local = 8
    try:
        nodes = int(torch_run.parse_min_max_nnodes(nnodes)[1])
    except Exception:
        nodes = 1
    nodes = max(1, nodes)
    return 64 + 4 * local + nodes * local, local, nodes


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``robustdist run ARGS`` (torchrun's ``ARGS``). Returns 0; a failed job raises as torchrun's does (its
    error summary, then exit code 1)."""
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.errors import record

    from robustdist.launcher.agent import Replacer

    parser = torch_run.get_args_parser()
    parser.prog = "robustdist run"
    parser.description = ("torchrun, whose agent starts a worker killed by a signal again alone when the training "
                          "script recovers in process (recovery.in_process); otherwise exactly torchrun. "
                          + (parser.description or ""))
    parser.add_argument("--spares", type=int, choices=(0, 1), default=1,
                        help="robustdist: warm spare processes per node (torch and robustdist imported, DDP's first "
                             "use done), each forking the next worker killed there (default 1; 0: a replacement starts "
                             "cold). Started with each attempt's workers, whether or not the script recovers in "
                             "process: 0 saves its memory where it does not.")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if not logging_configured():  # the launcher's own news (a worker replaced, the spare ready) to stderr, at INFO
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        for name in ("robustdist.launcher.agent", "robustdist.launcher.attempt_store", "robustdist.launcher.forked",
                     "robustdist.launcher.warm_spare", __name__):
            agent_log = logging.getLogger(name)
            agent_log.addHandler(handler)
            agent_log.setLevel(logging.INFO)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    needed, local, nodes = descriptors_needed(args.nproc_per_node, args.nnodes)
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning("robustdist run: the open-file limit is %d (ulimit -n); expected at least %d for its agent (the "
                    "attempt's store, the warm spare) with %d local worker(s) on up to %d node(s). Running exactly as "
                    "torchrun: a killed worker restarts every worker. Fix: raise the limit (ulimit -n %d or more) "
                    "before robustdist run.", soft, needed, local, nodes, max(1024, needed))
        os.environ.pop(RUN_ENV, None)  # one inherited (a launch inside a worker) would tell the workers otherwise
        record(torch_run.run)(args)
        return 0
    os.environ[RUN_ENV] = "1"  # this process is the launcher: its workers inherit it
    made = None
    if getattr(args, "log_dir", "") is None:  # torchrun's default: a temporary directory it never removes
        made = args.log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    replacer = Replacer(spares=args.spares)
    try:
        agent = _elastic_compat.elastic_agent_class(replacer, replacer.starting, replacer.stopped, replacer.wait)
        with _elastic_compat.launcher_agent(agent):
            record(torch_run.run)(args)
    finally:
        replacer.close()
        if made is not None:
            _remove_empty(made)
    return 0


def _remove_empty(top: str) -> None:
    """Remove ``top``'s empty directories, bottom up (and ``top`` if it ends empty); a file written there (a worker's
    error file, a redirected log) is kept, with the directories that lead to it."""
    for path, _, _ in os.walk(top, topdown=False):
        try:
            os.rmdir(path)
        except OSError:  # not empty
            pass
