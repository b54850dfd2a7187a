"""The exception tree, rank prefixes, and rank-aware logging and warnings."""

from __future__ import annotations

import logging
import pickle
import sys
import warnings

import pytest

from robustdist.runtime import errors
from robustdist.runtime.log import get_logger, warn


def test_exception_tree():
    assert issubclass(errors.ConfigError, errors.RobustDistError) and issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.MissingDependencyError, ImportError)
    assert issubclass(errors.CheckpointCorruptError, errors.CheckpointError)
    for name in ("TopologyError", "InitError", "StateDictMismatchError", "RankDivergenceError", "HangError"):
        assert issubclass(getattr(errors, name), errors.RobustDistError)
    assert issubclass(errors.RanksTimeout, errors.RanksFailed) and issubclass(errors.RanksTimeout, errors.HangError)
    assert issubclass(errors.RobustDistWarning, UserWarning)
    for name in errors.__all__:  # the tree in the docstring names every class
        assert name in errors.__doc__


def test_rank_prefix_and_ranks_survive_pickling():
    err = errors.InitError("ranks 2, 3 never reached the barrier", rank=0, ranks=[3, 2])
    assert str(err) == "[rank 0] ranks 2, 3 never reached the barrier"
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.rank, again.ranks, str(again)) == (errors.InitError, 0, (2, 3), str(err))
    assert str(errors.TopologyError("no rank")) == "no rank" and errors.TopologyError("x").rank is None


def test_logger_prefixes_rank_and_logs_info_on_rank_zero_only(monkeypatch, caplog):
    log = get_logger("robustdist.test")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with caplog.at_level(logging.INFO, logger="robustdist"):
        log.info("started %s", "init")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, "[rank 0/4] started init")]
    caplog.clear()
    monkeypatch.setenv("RANK", "3")
    with caplog.at_level(logging.INFO, logger="robustdist"):
        log.info("started")  # demoted to DEBUG on rank 3, so filtered at INFO
        log.warning("slow disk")
        log.info("everywhere", all_ranks=True)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "[rank 3/4] slow disk"), (logging.INFO, "[rank 3/4] everywhere")]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="robustdist"):
        log.info("demoted")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.DEBUG, "[rank 3/4] demoted")]
    assert caplog.records[0].funcName == "test_logger_prefixes_rank_and_logs_info_on_rank_zero_only"


def test_get_logger_is_namespaced():
    assert get_logger("custom").logger.name == "robustdist.custom"
    assert get_logger("robustdist.runtime.topology").logger.name == "robustdist.runtime.topology"


def test_warn_once_per_key(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn("pin_memory disabled", once="pin") is True
        assert warn("pin_memory disabled", once="pin") is False
        assert warn("no key warns every time") is True
    assert [str(w.message) for w in caught] == ["pin_memory disabled", "no key warns every time"]
    assert all(w.category is errors.RobustDistWarning for w in caught)


def _library_function():
    warn("from a library function")  # default stacklevel: blame whoever called the library function


def test_warning_points_at_the_user_code(monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _library_function()
        warn("direct", stacklevel=1)
    assert [w.filename for w in caught] == [__file__, __file__]
    assert caught[0].lineno != caught[1].lineno


def test_user_stacklevel_skips_every_package_of_robustdist():
    """The frames skipped are all of robustdist's, whichever package raises: a warning from the init package
    (outside runtime/, where user_stacklevel lives) points at this line, not at robustdist's own code."""
    import os

    import robustdist
    from robustdist.init import process_group
    from robustdist.runtime.log import PACKAGE_DIR

    assert PACKAGE_DIR == os.path.dirname(os.path.abspath(robustdist.__file__)) + os.sep
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        process_group._typed({}, "safe_init_process_group"); line = sys._getframe().f_lineno  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in caught] == [(DeprecationWarning, __file__, line)]


def test_warning_carries_rank_when_distributed(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(errors.RobustDistWarning, match=r"^\[rank 1/2\] shm is small$"):
        warn("shm is small")
