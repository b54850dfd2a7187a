"""robustdist inside the training frameworks users already run: Accelerate (and HF Trainer, which runs on it),
Lightning's Trainer and Fabric.

:mod:`.accelerate` tells whether an Accelerator is in charge of this process's DDP and data sharding (read from
modules already imported, never importing accelerate); :func:`robustdist.harden` uses it to compose (the
framework keeps its DDP and sampler, robustdist adds the watchdog, the step guard and atomic checkpoints) or to
refuse a double wrap at once. It also makes ``Accelerator.save_state``/``load_state`` atomic and verified:
:func:`save_state` commits a complete checkpoint or none, :func:`load_state` loads the newest one that
verifies, falling back to an older one. :mod:`.lightning` gives a Lightning ``Trainer`` a ``CheckpointIO`` plugin
(atomic, verified ``.ckpt`` files, falling back to an intact one) and a ``Callback`` (the watchdog, the NaN
policy). :mod:`.fabric` recognises what Lightning Fabric set up, so that harden keeps Fabric's DDP (or refuses a
wrapping it cannot compose with). :mod:`.wrapped` is what harden accepts from them: the framework it composes
with, a model another wrapper already wrapped refused, a loader the framework prepared kept.

Importing this package imports no framework (and not torch): each is imported when a function needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from robustdist.runtime.lazy import attach as _attach

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from robustdist.frameworks.accelerate import committed_states, load_state, save_state
    from robustdist.frameworks.lightning import callback, checkpoint_io

__getattr__, __dir__, __all__ = _attach(__name__, {
    **dict.fromkeys(["committed_states", "load_state", "save_state"], "robustdist.frameworks.accelerate"),
    **dict.fromkeys(["callback", "checkpoint_io"], "robustdist.frameworks.lightning"),
})
