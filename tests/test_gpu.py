"""The GPU tier (``pytest -m gpu``): what only a GPU can show. Skipped, with the reason, on
hosts without one. Each scenario runs in its own process (tests/workers/gpu_worker.py), because
logical GPUs must be configured before TensorFlow starts.

Covered: fit equivalence with and without XLA on every GPU (logical GPUs on a one-GPU host),
NCCL all-reduce and NCCL training on two or more physical GPUs, fp16 compression and the
clear bf16 error, ShardedOptimizer, ring on logical GPUs with int32 labels, the shared-GPU
fallback (auto -> ring, nccl refused), the per-device generators that copy each replica's batch
to its GPU, and ``tfdp-run --workers 2`` on one GPU.
"""

import json
import sys

import numpy as np
import pytest
import tensorflow as tf

import xla_cases
from helpers import mlp, train
from launching import run_job, tfdp_run_command, worker_env, worker_script

PHYSICAL_GPUS = len(tf.config.list_physical_devices("GPU"))
TIMEOUT = 900
TOLERANCE = 1e-5  # TF32 is off in the worker: float32 matmuls are exact float32

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(PHYSICAL_GPUS == 0, reason="no GPU on this host: the GPU tier "
                       "(pytest -m gpu) needs TensorFlow with CUDA and at least one GPU"),
]
needs_two_gpus = pytest.mark.skipif(PHYSICAL_GPUS < 2, reason="NCCL needs two physical GPUs "
                                    "(it refuses two ranks on one GPU)")


def run_scenario(tmp_path, scenario, logical=0):
    out = tmp_path / f"{scenario}.json"
    cmd = [sys.executable, worker_script("gpu_worker.py"), scenario, str(out)]
    if logical:
        cmd += ["--logical", str(logical)]
    code, output = run_job(cmd, worker_env(), TIMEOUT)
    assert code == 0, output
    return json.loads(out.read_text()), output


def assert_fit_equivalence(fit):
    assert sorted({k.split("/")[0] for k in fit}) == sorted(xla_cases.OPTIMIZERS)
    for key, r in fit.items():
        assert r["diff"] <= TOLERANCE, (key, r)
        if key.endswith("jit=True") and r["replicas"] > 1:
            assert r["split"], key  # tfdp's per-replica compiled step ran


def test_fit_equivalence_on_the_gpus_present_with_and_without_xla(tmp_path):
    # All physical GPUs as replicas (NCCL when there are two or more), or one GPU.
    result, _ = run_scenario(tmp_path, "fit")
    assert_fit_equivalence(result["fit"])


def test_xla_on_two_logical_gpus_trains_like_one_device(tmp_path):
    # The case that failed on an H100 for MirroredStrategy and tfdp alike: XLA's 'resource
    # located in device GPU:1'. Ring (shared GPU), int32 labels on GPUs included.
    result, out = run_scenario(tmp_path, "shared", logical=2)
    assert result["auto"] == "ring", result
    assert "NCCL refuses two ranks on one GPU" in (result["nccl_error"] or ""), result
    assert "uses ring collectives" in out  # said once, why
    assert_fit_equivalence(result["fit"])
    assert all(r["communication"] == "ring" for r in result["fit"].values())


def test_per_device_generators_traced_once_feed_gpu_replicas_like_tensorflows(tmp_path):
    # tfdp's per-device generator functions (the device_input feature) copy each replica's
    # batch from the host to its GPU: the same elements as TensorFlow's own generators.
    result, _ = run_scenario(tmp_path, "device_input", logical=0 if PHYSICAL_GPUS > 1 else 2)
    assert len(result["replicas"]) >= 2 and all("GPU" in d for d in result["replicas"]), result
    for name, got in result["cases"].items():
        assert got["equal"] and got["retraced"] == 0 and got["traced"] >= 2, (name, got)
        assert got["elements"] > 8, (name, got)


@needs_two_gpus
def test_nccl_all_reduce_and_training_on_physical_gpus(tmp_path):
    result, _ = run_scenario(tmp_path, "nccl")
    assert result["ok"] and result["replicas"] == PHYSICAL_GPUS, result
    assert result["int32_labels"]["diff"] <= TOLERANCE, result  # int32 labels over NCCL


def test_fp16_compression_on_gpus_within_its_tolerance(tmp_path):
    result, _ = run_scenario(tmp_path, "fp16", logical=0 if PHYSICAL_GPUS > 1 else 2)
    assert result["diff"] < 5e-3, result


def test_bf16_compression_on_gpus_is_a_clear_error(tmp_path):
    result, _ = run_scenario(tmp_path, "bf16", logical=0 if PHYSICAL_GPUS > 1 else 2)
    assert "compression='fp16'" in result["error"], result


def test_tfdp_run_two_workers_on_one_gpu(tmp_path):
    # The first thing people try on a one-GPU workstation: both workers see GPU 0, so
    # "auto" must pick ring (NCCL would fail with 'invalid usage').
    environ = worker_env(TFDP_TEST_OUT=tmp_path, TF_CPP_MIN_LOG_LEVEL=2, CUDA_VISIBLE_DEVICES=0)
    code, out = run_job(tfdp_run_command(worker_script("mw_xla_worker.py")), environ, TIMEOUT)
    assert code == 0, out
    assert "uses ring collectives" in out, out
    for opt_name, make in sorted(xla_cases.OPTIMIZERS.items()):
        saved = np.load(tmp_path / f"{opt_name}-0.npz")
        got = [saved[f"arr_{i}"] for i in range(len(saved.files) - 2)]
        x, y = xla_cases.data()
        ref, _ = train(None, mlp, make, x, y, xla_cases.GLOBAL_BATCH, epochs=xla_cases.EPOCHS,
                       weights=xla_cases.weights())
        for g, r in zip(got, ref.get_weights()):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)
