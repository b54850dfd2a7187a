"""``h.run(train_fn)`` and ``recovery.in_process``, on real gloo ranks, with a script in the shape of nanoGPT's
``train.py``: a small causal language model fed by ``get_batch`` (random windows of a token array, drawn with
torch's RNG), a cosine learning rate with warmup set by hand each iteration, gradient accumulation with
``no_sync`` on every micro-step but the last, gradient clipping and AdamW."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import time

import pytest
import torch
from torch import nn

from robustdist import harden
from robustdist.recovery import generation, history
from robustdist.recovery.faults import FaultWatch
from robustdist.runtime.errors import ConfigError
from robustdist.testing.ranks import run_ranks
from tests._torchrun import once_per_session
from tests.clients.ray_train_v2 import send_to_a_stopping_peer

pytestmark = pytest.mark.timeout(300)
MAX_ITERS, ACCUM, BLOCK, VOCAB = 10, 2, 8, 32


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, 16), nn.Embedding(BLOCK, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.ln, self.head = nn.LayerNorm(16), nn.Linear(16, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        mask = torch.triu(torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool), diagonal=1)
        x = x + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def get_lr(it: int) -> float:
    warmup, lr, min_lr = 3, 1e-2, 1e-3
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / (MAX_ITERS - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def _job(rank: int, root: str, in_process: bool, faults: list[tuple[int, int, int]], keep_old: bool,
         stall: tuple[int, int, str, float] | None = None, slow_watch: float = 0.0) -> dict:
    """``faults``: (rank, iteration, generation): that rank (-1: every rank) raises ValueError before the last
    micro-step's backward of that iteration, in that generation (the other rank is then in DDP's gradient
    all-reduce). ``keep_old``: the training function keeps generation 0's ``h.model`` in a variable of its own.
    ``stall``: (rank, iteration, "sleep" or "stop", seconds): in generation 0, that rank sleeps there, or stops
    itself (SIGSTOP; a helper process continues it that many seconds later), while the other waits in DDP's
    all-reduce; the watchdog (hang_timeout 3 s) gives the verdict. ``slow_watch``: this rank's fault watch acts
    that many seconds after it is woken (a busy machine's thread scheduling, made certain)."""
    if slow_watch:
        call = FaultWatch._call
        FaultWatch._call = lambda self: time.sleep(slow_watch) or call(self)  # type: ignore[method-assign]
    torch.manual_seed(1337)
    data = torch.randint(0, VOCAB, (512,), generator=torch.Generator().manual_seed(rank))

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - BLOCK, (4,))
        x = torch.stack([data[i:i + BLOCK] for i in ix])
        return x, torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])

    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    cfg = {"checkpoint": {"dir": f"{root}/ckpt", "every_n_steps": 100, "local_every_n_steps": 1,
                          "local_dir": f"{root}/shm"},
           "health": {"hang_timeout": 3 if stall else None},
           "recovery": {"in_process": in_process},
           # a collective waits for 300 s, so only the hang verdict ends a stall in time; init_timeout bounds
           # how long the ranks wait for each other's decision after a fault (15 s)
           "distributed": {"timeout": 300 if stall else 60, "init_timeout": 15 if stall else 60,
                           "barrier_timeout": 60}}
    seen: list[tuple[int, int, str]] = []
    kept: list[nn.Module] = []
    faults_here = {(rank if r == -1 else r, it, g) for r, it, g in faults}

    def train(h, iter_num: int) -> int:
        loaded = h.last_loaded
        seen.append((generation(), iter_num, loaded.source if loaded is not None else "none"))
        if keep_old and not kept:
            kept.append(h.model)
        while iter_num < MAX_ITERS:
            for group in optimizer.param_groups:
                group["lr"] = get_lr(iter_num)
            for micro_step in range(ACCUM):
                last = micro_step == ACCUM - 1
                x, y = get_batch()
                with contextlib.nullcontext() if last else h.model.no_sync():
                    loss = h.model(x, y) / ACCUM
                    if last and (rank, iter_num + 1, generation()) in faults_here:
                        raise ValueError(f"boom in iteration {iter_num + 1}")
                    if last and stall and (stall[2] == "stop-in-send" or rank == stall[0]) \
                            and (iter_num + 1, 0) == (stall[1], generation()):
                        if stall[2] == "sleep":
                            time.sleep(stall[3])
                        elif stall[2] == "stop-in-send":  # pipeline-style activations, 200 MB: rank 1 stops
                            send_to_a_stopping_peer(rank, stall[3])  # mid-transfer
                        else:
                            subprocess.Popen(["sh", "-c", f"sleep {stall[3]}; kill -CONT {os.getpid()}"])
                            os.kill(os.getpid(), signal.SIGSTOP)
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            iter_num += 1
            h.save(iter_num, optimizer=optimizer)
        return iter_num

    h = harden(model, None, cfg, optimizer=optimizer)
    out: dict = {"pid": os.getpid()}
    start = time.monotonic()
    try:
        out["end"] = h.run(train, optimizer=optimizer)
    except Exception as e:
        out["raised"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - start
    out["history"] = [(r.generation, r.own, r.step, r.source, r.from_process, r.detect_s,
                       [r.decide_s, r.teardown_s, r.rebuild_s, r.restore_s]) for r in history()]
    out.update(seen=seen, generation=generation(), closed=h.closed,
               params=[p.detach().clone() for p in model.parameters()],
               current_is_kept=bool(kept) and h.model is kept[0])
    if kept and kept[0] is not h.model:  # generation 0's DDP, kept by the script: retired, and says so
        try:
            kept[0](*get_batch())
            out["old"] = "ran"
        except RuntimeError as e:
            out["old"] = str(e)
    return out


def _straight(tmp_path_factory, in_process: bool) -> list[dict]:
    """What each rank of a run without faults returns (``recovery.in_process`` as given): made once per session."""
    def make(root):
        out = run_ranks(_job, 2, args=(str(root), in_process, [], False), init=False, timeout=180)
        torch.save(out, root / "out.pt")

    made = once_per_session(tmp_path_factory, f"{__name__} straight in_process={in_process}", make)
    return torch.load(made / "out.pt", weights_only=False)


@pytest.mark.processes
@pytest.mark.parametrize("keep_old", [False, True], ids=["h-model", "kept-generation-0-module"])
def test_h_run_recovers_a_nanogpt_shaped_loop_in_process_bitwise(tmp_path, tmp_path_factory, keep_old):
    faulted = run_ranks(_job, 2, args=(str(tmp_path / "a"), True, [(1, 6, 0)], keep_old), init=False, timeout=180)
    straight = _straight(tmp_path_factory, in_process=False)
    for rank in range(2):
        got, ref = faulted[rank], straight[rank]
        assert got["end"] == ref["end"] == MAX_ITERS and got["closed"] and got["generation"] == 0
        # generation 1 resumed iteration 5 (the fault came in iteration 6) in the same process, from memory
        assert [(g, s) for g, s, _ in got["seen"]] == [(0, 0), (1, 5)], got["seen"]
        assert got["seen"][1][2] != "durable", got["seen"]
        assert ref["seen"] == [(0, 0, "none")] and ref["history"] == []
        # where the recovery's time went: one record per rank; each rank's own state restored from its memory
        [(gen, own, step, source, from_process, detect, parts)] = got["history"]
        assert (gen, own, step, source, from_process) == (1, rank == 1, 5, "memory", True), got["history"]
        assert detect == 0.0 if rank == 1 else detect is not None and 0.0 <= detect < got["seconds"]
        assert all(p >= 0 for p in parts) and parts[0] <= parts[1] and sum(parts[1:]) < got["seconds"], parts
        assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))
        if keep_old:  # the module kept from generation 0 is not h.model any more, and fails loudly when used
            assert not got["current_is_kept"]
            assert "in-process recovery generation 0" in got["old"] and "h.model" in got["old"], got["old"]


@pytest.mark.processes
def test_a_lost_connection_seen_before_the_watch_wakes_is_the_other_rank_s_fault(tmp_path):
    # rank 1 raises; rank 0's all-reduce ends with the connection rank 1 shut, before rank 0's (slowed) watch has
    # acted on the declared fault: rank 0 reads it from the store, does not declare one of its own, and its record
    # says another rank's fault, detected when its collective ended
    out = run_ranks(_job, 2, args=(str(tmp_path), True, [(1, 6, 0)], False, None, 2.0), init=False, timeout=180)
    for rank in range(2):
        assert out[rank]["end"] == MAX_ITERS, out[rank]
        [(gen, own, step, _, _, detect, _)] = out[rank]["history"]
        assert (gen, own, step) == (1, rank == 1, 5), out[rank]["history"]
        assert detect is not None and 0.0 <= detect < 2.0, out[rank]["history"]


@pytest.mark.processes
@pytest.mark.parametrize("faults, generations", [
    ([(1, 4, 0), (0, 5, 1)], [(0, 0), (1, 3), (2, 4)]),
    ([(-1, 6, 0)], [(0, 0), (1, 5)]),
], ids=["two-quick-faults-on-different-ranks", "every-rank-at-once"])
def test_quick_and_simultaneous_faults_recover_bitwise(tmp_path, tmp_path_factory, faults, generations):
    faulted = run_ranks(_job, 2, args=(str(tmp_path / "a"), True, faults, False), init=False, timeout=180)
    straight = _straight(tmp_path_factory, in_process=True)
    for rank in range(2):
        got, ref = faulted[rank], straight[rank]
        assert got["end"] == ref["end"] == MAX_ITERS and got["generation"] == 0
        assert [(g, s) for g, s, _ in got["seen"]] == generations, got["seen"]
        assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))


@pytest.mark.processes
@pytest.mark.parametrize("how", ["sleep", "stop"])
def test_a_stall_shorter_than_the_decision_bound_recovers_in_process_bitwise(tmp_path, tmp_path_factory, how):
    """Rank 1 sleeps 6 s before its backward while rank 0 waits in the all-reduce (its heartbeats go on: the hang
    verdict, 3 s, is the fault), or is stopped for 6 s (SIGSTOP: its heartbeats stop, and rank 0 declares it
    faulty once they are stale, 2.25 s); rank 0 gets out of the collective, rank 1 fails its backward when it runs
    again, within the decision bound (15 s), and both recover."""
    faulted = run_ranks(_job, 2, args=(str(tmp_path / "a"), True, [], False, (1, 6, how, 6.0)), init=False,
                        timeout=240)
    straight = _straight(tmp_path_factory, in_process=True)
    for rank in range(2):
        got, ref = faulted[rank], straight[rank]
        assert "raised" not in got, got["raised"]
        assert [(g, s) for g, s, _ in got["seen"]] == [(0, 0), (1, 5)], got["seen"]
        assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))


@pytest.mark.processes
def test_a_stopped_rank_makes_every_rank_escalate_long_before_the_collective_timeout(tmp_path):
    """Rank 1 is stopped (SIGSTOP) for 30 s: its heartbeats stop, and rank 0 declares it faulty once they are stale
    (3 intervals: 2.25 s, before rank 0's own hang verdict at 3 s), which gets rank 0 out of the all-reduce; rank 1
    says nothing within the decision bound (init_timeout, 15 s), so rank 0 escalates (the launcher would restart
    the job), not after the collective timeout (300 s). Rank 1, continued, sees rank 0's decision and escalates.
    The stop outlasts rank 0's escalation (2.25 s + 15 s, both on the clock, and its teardown) by over 10 s, which
    a loaded machine's scheduling delays stay well within."""
    out = run_ranks(_job, 2, args=(str(tmp_path / "a"), True, [], False, (1, 6, "stop", 30.0)), init=False,
                    timeout=240)
    assert "raised" in out[0] and "raised" in out[1], out
    # rank 0's own error is the all-reduce the declaration cut short: it raises the named error, naming rank 1
    assert out[0]["raised"].startswith("RecoveryError: [rank 0] in-process recovery generation 0 ended: a declared "
                                       "fault (generation 0: rank 1 (") and "HeartbeatsStopped: no new heartbeat " \
        "from rank 1 for " in out[0]["raised"] and "found by rank 0" in out[0]["raised"], out[0]["raised"]
    assert out[0]["seconds"] < 120, out[0]  # 2.25 s + 15 s and the steps before; not 300 s
    for rank in range(2):
        assert [g for g, _, _ in out[rank]["seen"]] == [0], out[rank]["seen"]


@pytest.mark.processes
def test_a_rank_stuck_in_a_send_that_the_teardown_cannot_end_exits_at_once_for_a_restart(tmp_path):
    """Rank 1 stops (SIGSTOP, 8 s) while rank 0's 200 MB send to it is under way: rank 0 declares rank 1's stopped
    heartbeats and shuts its group's connections down, but gloo does not end that send (it would wait for the
    collective timeout, 300 s). Rank 0 finds its training thread stuck, escalates, waits (bounded) for rank 1's
    decision (its process serves the store) and exits with the hang code; rank 1, continued, is stuck the same way
    in its receive, half filled when the connection closed, and exits too. Both errors are recorded for the
    restart-loop guard, and the launcher would restart the job within seconds, not after the timeout."""
    from robustdist.health.restart_guard import _last_errors
    from robustdist.health.watchdog import HANG_EXIT_CODE
    from robustdist.runtime.errors import RanksFailed

    start = time.monotonic()
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_job, 2, args=(str(tmp_path / "a"), True, [], False, (1, 6, "stop-in-send", 8.0)), init=False,
                  timeout=240)
    took = time.monotonic() - start
    assert set(failed.value.failures) == {0, 1}, failed.value.failures
    for rank in range(2):
        assert f"rank {rank} exited with code {HANG_EXIT_CODE} without returning" in failed.value.failures[rank]
    assert took < 120, took  # the steps before, 8 s stopped, 2 s to judge each; not the 300 s timeout
    errors = _last_errors(str(tmp_path / "a/ckpt"), [0])
    for rank in range(2):
        assert f"[rank {rank}] in-process recovery generation 0: this rank's training thread is still blocked in " \
            "send_to_a_stopping_peer (ray_train_v2.py:" in errors, errors


@pytest.mark.processes
def test_a_run_that_cannot_recover_in_place_takes_the_ordinary_path(tmp_path, monkeypatch):
    """TORCH_GLOO_LAZY_INIT: gloo connects after the group is made, so nothing could be unblocked. h.run says so and
    runs the ordinary way: the fault ends the run on every rank, with no recovery attempted."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    out = run_ranks(_job, 2, args=(str(tmp_path), True, [(1, 6, 0)], False), init=False, timeout=180)
    assert out[1]["raised"] == "ValueError: boom in iteration 6"
    assert "raised" in out[0]
    for rank in range(2):
        assert [g for g, _, _ in out[rank]["seen"]] == [0] and out[rank]["closed"], out[rank]


def _single(root: str, in_process: bool, fail_at: int | None) -> tuple[int | str, list[int]]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"checkpoint": {"dir": f"{root}/ckpt", "every_n_steps": 1}, "health": {"hang_timeout": None},
           "recovery": {"in_process": in_process}}
    starts: list[int] = []

    def train(h, step: int) -> int:
        starts.append(step)
        while step < 6:
            h.model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            h.save(step, optimizer=optimizer)
            if step == fail_at:
                raise ValueError(f"boom at step {step}")
        return step

    h = harden(model, None, cfg, optimizer=optimizer)
    try:
        end: int | str = h.run(train, optimizer=optimizer)
    except ValueError as e:
        end = str(e)
    assert h.closed
    with pytest.raises(ConfigError, match=r"h.run\(\) was called on a closed Hardened"):
        h.run(train, optimizer=optimizer)
    return end, starts


@pytest.mark.parametrize("in_process", [False, True], ids=["mode-off", "mode-on"])
def test_one_process_runs_the_function_once_and_a_fault_ends_it(tmp_path, monkeypatch, in_process):
    """One process (no launcher): the fault leaves h.run (no one to recover with; the next launch resumes)."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    assert _single(str(tmp_path), in_process, fail_at=3) == ("boom at step 3", [0])
    assert _single(str(tmp_path), in_process, fail_at=None) == (6, [3])  # resumed from step 3's checkpoint


def test_the_mode_needs_a_checkpoint_directory_and_a_boolean():
    with pytest.raises(ConfigError, match=r"recovery.in_process is true but checkpoint.dir is None"):
        harden(nn.Linear(2, 2), None, {"recovery": {"in_process": True}})
    with pytest.raises(ConfigError, match=r"recovery.in_process"):
        harden(nn.Linear(2, 2), None, {"recovery": {"in_process": "yes"}, "checkpoint": {"dir": "/tmp/x"}})
