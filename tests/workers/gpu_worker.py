"""One GPU-tier scenario per process (tests/test_gpu.py): GPUs must be split into logical
devices before TensorFlow initialises them, so every scenario gets a fresh process. It finds
tests/helpers.py through PYTHONPATH (tests/launching.py's worker_env).

usage: python tests/workers/gpu_worker.py SCENARIO OUT.json [--logical N]

Prints nothing on success but what the scenario logs; writes its results to OUT.json.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf


def split_first_gpu(n):
    """``n`` logical GPUs on the first physical GPU (before the runtime starts)."""
    gpu = tf.config.list_physical_devices("GPU")[0]
    tf.config.set_logical_device_configuration(
        gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=4096) for _ in range(n)])


def max_diff(a, b):
    return float(max(np.abs(np.asarray(u) - np.asarray(v)).max() for u, v in zip(a, b)))


def fit_equivalence(strategy_kwargs):
    """Every optimizer of xla_cases, with and without XLA, against one device without a
    strategy (TF32 off: exact float32 matmuls)."""
    import keras
    import tfdp
    import xla_cases
    from helpers import mlp, train
    from tfdp.strategy import xla

    x, y = xla_cases.data()
    results = {}
    for name, make in sorted(xla_cases.OPTIMIZERS.items()):
        ref, _ = train(None, mlp, make, x, y, xla_cases.GLOBAL_BATCH, epochs=xla_cases.EPOCHS,
                       weights=xla_cases.weights(), compile_kwargs={"jit_compile": False})
        for jit in (False, True):
            strategy = tfdp.DataParallelStrategy(**strategy_kwargs)
            got, _ = train(strategy, mlp, make, x, y, xla_cases.GLOBAL_BATCH,
                           epochs=xla_cases.EPOCHS, weights=xla_cases.weights(),
                           compile_kwargs={"jit_compile": jit})
            results[f"{name}/jit={jit}"] = {
                "diff": max_diff(got.get_weights(), ref.get_weights()),
                "split": xla.compiled_train_step(got) is not None,
                "replicas": strategy.num_replicas_in_sync,
                "communication": strategy.communication}
        keras.backend.clear_session()
    return results


def nccl_all_reduce():
    import tfdp
    strategy = tfdp.DataParallelStrategy(communication="nccl")
    n = strategy.num_replicas_in_sync
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.fill([1000], float(ctx.replica_id_in_sync_group + 1)))

    @tf.function
    def step():
        return strategy.run(lambda v: tf.distribute.get_replica_context().all_reduce("sum", v),
                            args=(values,))

    parts = [p.numpy() for p in strategy.experimental_local_results(step())]
    return {"replicas": n, "ok": all(np.all(p == n * (n + 1) / 2) for p in parts),
            "int32_labels": fit_equivalence({"communication": "nccl"})["sgd_momentum/jit=False"]}


def compression(kind):
    import keras
    import tfdp
    from helpers import classification_data, initial_weights, mlp, train

    x, y = classification_data()
    def sgd():
        return keras.optimizers.SGD(0.1)
    ref, _ = train(None, mlp, sgd, x, y, 64, weights=initial_weights(mlp))
    try:
        got, _ = train(tfdp.DataParallelStrategy(compression=kind), mlp, sgd, x, y, 64,
                       weights=initial_weights(mlp))
    except ValueError as e:
        return {"error": str(e)}
    return {"diff": max_diff(got.get_weights(), ref.get_weights())}


def shared_gpu():
    """Two logical GPUs on one physical GPU: auto picks ring, nccl is refused."""
    import tfdp
    auto = tfdp.DataParallelStrategy()
    try:
        tfdp.DataParallelStrategy(communication="nccl")
        nccl_error = None
    except ValueError as e:
        nccl_error = str(e)
    return {"auto": auto.communication, "nccl_error": nccl_error,
            "fit": fit_equivalence({})}


def device_input():
    """The per-device generators traced once (feature device_input) feeding GPU replicas:
    the same elements as TensorFlow's own, nothing traced by a second iterator."""
    import tfdp
    from data_helpers import PER_DEVICE_ELEMENTS, generators_against_tensorflows

    strategy = tfdp.DataParallelStrategy()
    return {"replicas": list(strategy.extended.worker_devices),
            "cases": {name: generators_against_tensorflows(strategy, make)
                      for name, make in sorted(PER_DEVICE_ELEMENTS.items())}}


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    logical = int(sys.argv[sys.argv.index("--logical") + 1]) if "--logical" in sys.argv else 0
    tf.config.experimental.enable_tensor_float_32_execution(False)
    if logical:
        split_first_gpu(logical)
    import tfdp  # noqa: F401  (after the device configuration)
    result = {"fit": lambda: {"fit": fit_equivalence({})},
              "nccl": nccl_all_reduce,
              "fp16": lambda: compression("fp16"),
              "bf16": lambda: compression("bf16"),
              "shared": shared_gpu,
              "device_input": device_input}[scenario]()
    result["devices"] = [d.name for d in tf.config.list_logical_devices("GPU")]
    details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
    result["gpu"] = details.get("device_name", "unknown")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
