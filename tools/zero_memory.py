"""ZeRO-1 memory and step time: tfdp.ShardedOptimizer against the unsharded optimizer.

Prints, for N = 1, 2, 4, 8 logical CPU replicas, the optimizer-state bytes each replica
holds (measured from the variables on each device), and the step time of sharded and
unsharded Adam measured in one run, interleaved, as a ratio.

    python tools/zero_memory.py            # writes docs/zero_memory.md
"""

from __future__ import annotations

import os
import time

from absl import app, flags, logging as absl_logging

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FLAGS = flags.FLAGS
flags.DEFINE_list("replicas", ["1", "2", "4", "8"], "Replica counts for the memory table.")
flags.DEFINE_integer("width", 256, "Hidden width of the model (a deep MLP with many variables).")
flags.DEFINE_integer("depth", 12, "Hidden layers.")
flags.DEFINE_integer("time_replicas", 4, "Replicas for the step-time comparison.")
flags.DEFINE_integer("windows", 11, "Interleaved timing windows per variant.")
flags.DEFINE_integer("steps_per_window", 20, "Training steps per timing window.")
flags.DEFINE_string("out", "docs/zero_memory.md", "Markdown report ('' to skip).")


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)
    import numpy as np
    import keras
    import tensorflow as tf

    import tfdp
    from tfdp.sharding import optimizer_state_bytes_per_replica

    counts = [int(n) for n in FLAGS.replicas]
    tfdp.configure_cpu_replicas(max(counts + [FLAGS.time_replicas]))

    def make_model():
        layers = [keras.Input((64,))]
        layers += [keras.layers.Dense(FLAGS.width, activation="relu") for _ in range(FLAGS.depth)]
        return keras.Sequential(layers + [keras.layers.Dense(10)])

    rows = []
    for n in counts:
        strategy = tfdp.DataParallelStrategy(devices=[f"/device:CPU:{i}" for i in range(n)])
        with strategy.scope():
            model = make_model()
            plain = keras.optimizers.Adam()
            plain.build(model.trainable_variables)
            sharded = tfdp.ShardedOptimizer(keras.optimizers.Adam())
            sharded.build(model.trainable_variables)
        full = optimizer_state_bytes_per_replica(plain, strategy)[0]
        per = sharded.state_bytes_per_replica()
        rows.append((n, full, max(per), min(per), max(per) / full, 1 / n))
        print(f"N={n}: unsharded {full:,} B/replica; sharded max {max(per):,} min {min(per):,} "
              f"(max/unsharded {max(per) / full:.3f}, ideal {1 / n:.3f})", flush=True)
    params = model.count_params()

    # Step time, interleaved: sharded and unsharded alternate so drift hits both.
    n = FLAGS.time_replicas
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 64)).astype("float32")
    y = rng.integers(0, 10, size=4096).astype("int32")
    fits = {}
    for name in ("unsharded", "sharded"):
        strategy = tfdp.DataParallelStrategy(devices=[f"/device:CPU:{i}" for i in range(n)])
        with strategy.scope():
            model = make_model()
            opt = keras.optimizers.Adam(1e-3)
            model.compile(optimizer=tfdp.ShardedOptimizer(opt) if name == "sharded" else opt,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        data = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)).repeat(),
                                    global_batch_size=64 * n)
        model.fit(data, epochs=1, steps_per_epoch=5, verbose=0)  # trace + warm up
        fits[name] = (model, data)
    times = {name: [] for name in fits}
    for w in range(FLAGS.windows):
        for name, (model, data) in fits.items():
            t = time.perf_counter()
            model.fit(data, epochs=1, steps_per_epoch=FLAGS.steps_per_window, verbose=0)
            times[name].append((time.perf_counter() - t) / FLAGS.steps_per_window)
        print(f"window {w + 1}/{FLAGS.windows}: " + ", ".join(
            f"{k} {v[-1] * 1e3:.1f} ms/step" for k, v in times.items()), flush=True)
    med = {k: float(np.median(v)) for k, v in times.items()}
    ratio = med["sharded"] / med["unsharded"]
    print(f"step time on {n} replicas: unsharded {med['unsharded'] * 1e3:.1f} ms, sharded "
          f"{med['sharded'] * 1e3:.1f} ms, sharded/unsharded = {ratio:.2f}")

    lines = [
        "# ZeRO-1 optimizer-state memory (tools/zero_memory.py)", "",
        f"Model: MLP, {FLAGS.depth} hidden layers of {FLAGS.width} ({params:,} parameters, "
        f"{2 * FLAGS.depth + 2} variables); optimizer Adam (2 float32 slots per parameter). "
        "Bytes measured from the variables on each device.", "",
        "| replicas N | unsharded bytes/replica | sharded max bytes/replica | sharded min | max/unsharded | ideal 1/N |",
        "|---:|---:|---:|---:|---:|---:|",
    ] + [f"| {n} | {f:,} | {mx:,} | {mn:,} | {r:.3f} | {i:.3f} |" for n, f, mx, mn, r, i in rows] + [
        "", f"Step time on {n} CPU replicas (median of {FLAGS.windows} interleaved windows of "
        f"{FLAGS.steps_per_window} steps, per-replica batch 64): unsharded "
        f"{med['unsharded'] * 1e3:.1f} ms, sharded {med['sharded'] * 1e3:.1f} ms, "
        f"**sharded/unsharded = {ratio:.2f}**.", ""]
    if FLAGS.out:
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        with open(FLAGS.out, "w") as f:
            f.write("\n".join(lines))
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
