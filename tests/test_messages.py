"""Remedy messages that other test files do not already pin: each names what was found, what was expected
and the fix."""

from __future__ import annotations

import pytest
import torch

from robustdist.checkpoint import AtomicCheckpointer
from robustdist.parallel.fsdp import Calibration, fsdp_calibrate
from robustdist.ray import actor as ray_actor
from robustdist.ray.actor import RobustGPUActor, gpu_positions
from robustdist.ray.memory import ray_memory_plan
from robustdist.runtime.errors import CheckpointError, ConfigError, InitError, TopologyError


def test_memory_plan_out_of_range():
    with pytest.raises(ConfigError) as exc:
        ray_memory_plan(total_ram=1 << 34, headroom=1.5)
    assert str(exc.value) == ("headroom=1.5 is out of range; expected bytes >= 0 (total_ram > 0) and fractions in "
                              "(0, 1] (headroom in [0, 1)). Fix: pass a value in range.")


def test_fsdp_bad_strategy_and_mixed_precision(monkeypatch):
    with pytest.raises(ConfigError, match=r"^strategy='ZERO3'; expected 'auto' or one of \('FULL_SHARD', "
                                          r"'HYBRID_SHARD', 'NO_SHARD'\)\. Fix: pass one of those\.$"):
        fsdp_calibrate(strategy="ZERO3")
    cal = Calibration(1, 0, 1, 1, 0, torch.device("cpu"), 0, (1,), ("shard",), "NO_SHARD")
    monkeypatch.setattr(Calibration, "device_mesh", lambda self: None)
    with pytest.raises(ConfigError, match=r"^mixed_precision='fp16'; expected None or 'bf16'\. Fix: pass one of those\.$"):
        cal.fully_shard_kwargs(mixed_precision="fp16")


def test_gpu_ids_without_cuda(monkeypatch):
    monkeypatch.setattr(ray_actor, "_assigned_gpu_ids", lambda: ["0"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(TopologyError) as exc:
        RobustGPUActor()
    assert str(exc.value) == ("Ray assigned GPU ids ['0'] but torch.cuda.is_available() is False "
                              "(CUDA_VISIBLE_DEVICES='0'); expected a CUDA build of torch and a driver. Fix: install a "
                              "CUDA torch in the worker image, or request num_gpus=0.")
    with pytest.raises(TopologyError, match=r"Ray assigned GPU ids \['GPU-ab'\] but CUDA_VISIBLE_DEVICES is unset, .*"
                                            r"Fix: let Ray set CUDA_VISIBLE_DEVICES"):
        gpu_positions(["GPU-ab"], None)


def test_missing_master_port(monkeypatch):
    from robustdist.init.process_group import safe_init_process_group

    for var in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "GLOO_SOCKET_IFNAME", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(InitError, match=r"MASTER_PORT is not set; expected a free TCP port on the master node\. "
                                        r"Fix: export MASTER_PORT=29500"):
        safe_init_process_group({"distributed": {"timeout": 30}})


def test_checkpoint_refuses_non_plain_keys_and_non_dict_state(tmp_path):
    with AtomicCheckpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match=r"checkpoint key state\['x'\]\[\(1, 2\)\] is a tuple; expected str "
                                                  r"keys or int keys .* Fix: convert the key"):
            ckpt.save(1, {"x": {(1, 2): 3}})
        with pytest.raises(CheckpointError, match=r"state is a list; expected a dict of named entries\. Fix: pass "
                                                  r"\{'model': model, 'optimizer': optimizer, \.\.\.\}\."):
            ckpt.save(1, [1, 2])
