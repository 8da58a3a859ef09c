"""Every tfdp.horovod collective against numpy, on every rank of a tfdp-run job.

Each rank's inputs are a function of its rank, so every rank computes the expected result
with numpy itself. Checks run eagerly and inside a tf.function (where marked); each rank
writes OUT/collectives-<rank>.json: {"checks": number run, "failures": [what differed]}.

Env knob: TFDP_TEST_OUT.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf

import tfdp.horovod as hvd

hvd.init()
N, R = hvd.size(), hvd.rank()
checks, failures = [0], []


def check(name, got, want, rtol=0.0, atol=0.0):
    checks[0] += 1
    if isinstance(want, str):
        if got != want:
            failures.append(f"{name}: got {got}, want {want}")
        return
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        failures.append(f"{name}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
    elif not np.allclose(got, want, rtol=rtol, atol=atol):
        failures.append(f"{name}: got {got.tolist()}, want {want.tolist()}")


def value(rank, shape, dtype):
    rng = np.random.default_rng(100 + rank)
    return (rng.integers(-9, 10, size=shape) + (0.25 if np.dtype(dtype).kind == "f" else 0)
            ).astype(dtype)


every = [value(r, (2, 3, 4), np.float32) for r in range(N)]
# --- the ranks ---
check("size", hvd.size(), N)
check("local_rank", hvd.local_rank(), R)  # every worker on 127.0.0.1
check("local_size", hvd.local_size(), N)
check("cross_size", hvd.cross_size(), 1)
check("cross_rank", hvd.cross_rank(), 0)

# --- allreduce: dtypes x shapes x ops, eagerly ---
for dtype in (np.float32, np.float64, np.int32):
    for shape in ((), (5,), (2, 3, 4)):
        xs = np.stack([value(r, shape, dtype) for r in range(N)])
        mine = tf.constant(xs[R])
        tag = f"{np.dtype(dtype).name}{shape}"
        total = xs.sum(0).astype(dtype)
        check(f"sum {tag}", hvd.allreduce(mine, op=hvd.Sum), total)
        mean = (xs.sum(0) / N).astype(dtype) if np.dtype(dtype).kind == "f" else \
            np.trunc(xs.sum(0) / N).astype(dtype)
        check(f"average {tag}", hvd.allreduce(mine), mean, rtol=1e-6)
        check(f"average=False {tag}", hvd.allreduce(mine, average=False), total)
        check(f"min {tag}", hvd.allreduce(mine, op=hvd.Min), xs.min(0))
        check(f"max {tag}", hvd.allreduce(mine, op=hvd.Max), xs.max(0))
        check(f"product {tag}", hvd.allreduce(mine, op=hvd.Product), xs.prod(0).astype(dtype))

xs = np.stack(every)
check("prescale/postscale", hvd.allreduce(tf.constant(xs[R]), op=hvd.Sum, prescale_factor=0.5,
                                          postscale_factor=3.0), xs.sum(0) * 1.5, rtol=1e-6)
check("fp16 compression",
      hvd.allreduce(tf.constant(xs[R] * 1.001), compression=hvd.Compression.fp16),
      (xs * 1.001).mean(0).astype(np.float32), rtol=2e-3, atol=1e-2)
# The guard: float16 really is on the wire (1.0001 is 1.0 in float16).
check("fp16 rounds", hvd.allreduce(tf.constant([1.0001]), compression=hvd.Compression.fp16),
      np.array([1.0], np.float32))
check("no compression keeps float32", hvd.allreduce(tf.constant([1.0001])),
      np.array([1.0001], np.float32), rtol=1e-7)
group = hvd.grouped_allreduce([tf.constant(xs[R]), tf.constant([R + 1], tf.int32), None],
                              op=hvd.Sum)
check("grouped float", group[0], xs.sum(0))
check("grouped int", group[1], np.array([N * (N + 1) // 2], np.int32))
checks[0] += 1
if group[2] is not None:
    failures.append("grouped None")
slices = tf.IndexedSlices(tf.constant([[R + 1.0, 1.0]]), tf.constant([R]), tf.constant([N, 2]))
dense = tf.convert_to_tensor(hvd.allreduce(slices, op=hvd.Average))
check("IndexedSlices average", dense,
      np.array([[(r + 1.0) / N, 1.0 / N] for r in range(N)], np.float32))

# --- allgather: uneven first dimension, dtypes, scalars ---
for dtype in (np.float32, np.float64, np.int32):
    parts = [value(r, (r + 1, 2), dtype) for r in range(N)]
    check(f"allgather uneven {np.dtype(dtype).name}", hvd.allgather(tf.constant(parts[R])),
          np.concatenate(parts))
check("allgather scalar", hvd.allgather(tf.constant(R * 10)), np.arange(N, dtype=np.int32) * 10)
check("allgather empty on rank 0",
      hvd.allgather(tf.zeros([0 if R == 0 else 2, 3])), np.zeros([2 * (N - 1), 3], np.float32))

# --- broadcast: from root 1 and 0, dtypes ---
for root in (1, 0):
    for dtype in (np.float32, np.float64, np.int32):
        check(f"broadcast root {root} {np.dtype(dtype).name}",
              hvd.broadcast(tf.constant(value(R, (3, 2), dtype)), root_rank=root),
              value(root, (3, 2), dtype))
variables = [tf.Variable(value(R, (4,), np.float32)), tf.Variable(value(R, (2, 2), np.int32))]
hvd.broadcast_variables(variables, root_rank=1)
check("broadcast_variables float", variables[0].numpy(), value(1, (4,), np.float32))
check("broadcast_variables int", variables[1].numpy(), value(1, (2, 2), np.int32))
check("broadcast_object", json.dumps(hvd.broadcast_object({"rank": R, "data": list(range(R * 7))},
                                                          root_rank=1)),
      json.dumps({"rank": 1, "data": list(range(7))}))
check("allgather_object", json.dumps(hvd.allgather_object(("r", R, "x" * R))),
      json.dumps([("r", r, "x" * r) for r in range(N)]))

# --- alltoall, reducescatter ---
splits = [(R + j) % 2 + 1 for j in range(N)]  # rows rank R sends to rank j
sent = [np.full((splits[j], 2), 10 * R + j, np.float32) for j in range(N)]
got, got_splits = hvd.alltoall(tf.constant(np.concatenate(sent)), splits=splits)
want = np.concatenate([np.full(((r + R) % 2 + 1, 2), 10 * r + R, np.float32) for r in range(N)])
check("alltoall splits", got, want)
check("alltoall received_splits", got_splits, np.array([(r + R) % 2 + 1 for r in range(N)],
                                                      np.int32))
check("alltoall even", hvd.alltoall(tf.constant(np.arange(2 * N, dtype=np.int32) + 100 * R)),
      np.array([100 * r + 2 * R + k for r in range(N) for k in range(2)], np.int32))
rows = 2 * N + 1
full = np.stack([value(r, (rows, 2), np.float32) for r in range(N)]).sum(0)
begin = R * 2 + min(R, 1)
check("reducescatter sum", hvd.reducescatter(tf.constant(value(R, (rows, 2), np.float32)),
                                             op=hvd.Sum),
      full[begin:begin + 2 + (1 if R < 1 else 0)])


# --- inside a tf.function ---
@tf.function
def traced(x, part, root_value):
    return (hvd.allreduce(x, op=hvd.Sum), hvd.allreduce(x), hvd.allgather(part),
            hvd.broadcast(root_value, root_rank=1), hvd.allreduce(x, op=hvd.Max))


parts = [value(r, (r + 2, 3), np.float64) for r in range(N)]
for repeat in range(2):
    s, a, g, b, m = traced(tf.constant(xs[R]), tf.constant(parts[R]),
                           tf.constant(value(R, (2,), np.int32)))
    check(f"tf.function sum #{repeat}", s, xs.sum(0))
    check(f"tf.function average #{repeat}", a, xs.mean(0), rtol=1e-6)
    check(f"tf.function uneven allgather #{repeat}", g, np.concatenate(parts))
    check(f"tf.function broadcast #{repeat}", b, value(1, (2,), np.int32))
    check(f"tf.function max #{repeat}", m, xs.max(0))
hvd.barrier()

with open(os.path.join(os.environ["TFDP_TEST_OUT"], f"collectives-{R}.json"), "w") as f:
    json.dump({"checks": checks[0], "failures": failures}, f)
print(f"rank {R}: {checks[0]} checks, {len(failures)} failures", flush=True)
