"""The private names of torch's DataLoader that robustdist uses, fenced here (and nowhere else:
``tests/test_private_api.py``), listed in :data:`PRIVATE_APIS` like ``_torch_compat``'s.

``safe_dataloader``'s mid-epoch position rides on them: a hook after each batch (torch's iterators under their own
class names, with ``_next_data`` counted), the sampler and the iterator a loader makes (``_index_sampler``,
``_get_iterator``), and the iterator a persistent-workers loader keeps (``_iterator``). Unlike the other fenced
names these have no degraded path; the canary (``tests/runtime/test_private_api_canaries.py``) is what guards
them.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data import dataloader as _loader

from robustdist.runtime._torch_compat import _VERIFIED, _attr
from robustdist.runtime.private_api import PrivateAPI

__all__ = ["PRIVATE_APIS", "BaseDataLoaderIter", "LoaderHooks", "MultiProcessingDataLoaderIter",
           "SingleProcessDataLoaderIter", "live_iterator"]

BaseDataLoaderIter: type = _loader._BaseDataLoaderIter


class _Counting:
    """torch's ``_next_data`` with a hook after each batch: ``rd_batch(finished)`` (False after a batch, True when
    the iterator runs out)."""

    def rd_batch(self, finished: bool) -> None:  # overridden by robustdist.data.epochs
        pass

    def _next_data(self) -> Any:
        try:
            data = super()._next_data()  # type: ignore[misc]
        except StopIteration:
            self.rd_batch(True)
            raise
        self.rd_batch(False)
        return data


# Under torch's class names: the profiler's record names use them.
class SingleProcessDataLoaderIter(_Counting, _loader._SingleProcessDataLoaderIter):
    """torch's single-process iterator, with the batch hook."""


class MultiProcessingDataLoaderIter(_Counting, _loader._MultiProcessingDataLoaderIter):
    """torch's worker-process iterator, with the batch hook."""


SingleProcessDataLoaderIter.__name__ = SingleProcessDataLoaderIter.__qualname__ = "_SingleProcessDataLoaderIter"
MultiProcessingDataLoaderIter.__name__ = MultiProcessingDataLoaderIter.__qualname__ = "_MultiProcessingDataLoaderIter"


class LoaderHooks:
    """Mixed in before ``DataLoader``: routes torch's private ``_index_sampler`` and ``_get_iterator`` to
    ``rd_index_sampler(inner)`` and ``rd_new_iterator()``."""

    def rd_index_sampler(self, inner: Any) -> Any:
        return inner

    def rd_new_iterator(self) -> Any:
        return DataLoader._get_iterator(self)  # type: ignore[arg-type]

    @property
    def _index_sampler(self) -> Any:
        return self.rd_index_sampler(DataLoader._index_sampler.fget(self))  # type: ignore[attr-defined]

    def _get_iterator(self) -> Any:
        return self.rd_new_iterator()


def live_iterator(loader: DataLoader[Any]) -> Any:
    """The iterator a persistent-workers loader keeps for its next epoch (``DataLoader._iterator``), or None."""
    return getattr(loader, "_iterator", None)


def _probe_loader_hooks() -> Any:
    return all(_attr(c, n) is not None for c, n in (
        (DataLoader, "_get_iterator"), (DataLoader, "_index_sampler"), (_loader._BaseDataLoaderIter, "_next_data"),
        (_loader, "_SingleProcessDataLoaderIter"), (_loader, "_MultiProcessingDataLoaderIter"))) or None


def _probe_live_iterator() -> Any:
    loader = DataLoader([0, 1], persistent_workers=False)
    return hasattr(loader, "_iterator") or None


PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    PrivateAPI("torch.utils.data.DataLoader._get_iterator/_index_sampler, _BaseDataLoaderIter._next_data, "
               "_SingleProcessDataLoaderIter, _MultiProcessingDataLoaderIter", "torch",
               "safe_dataloader's mid-epoch position (batches counted, the sampler replayed)", _VERIFIED,
               _probe_loader_hooks),
    PrivateAPI("torch.utils.data.DataLoader._iterator", "torch",
               "telling an abandoned persistent-workers iterator from one a loop is in", _VERIFIED,
               _probe_live_iterator),
)
