"""Random draws under the strategy: each replica draws what one device draws on the global batch.

The problem. Keras's random ops are stateless draws from a seed that a ``SeedGenerator``
holds in a variable; under a strategy that variable is mirrored, so every replica draws from
the same seed and, with the same shape, the same numbers: the four replicas of a 4-replica
job apply the same Dropout mask to their four slices of the batch, where one device draws
four different ones (MirroredStrategy does the same).

Rule (``random_draws="as_one_device"``, the default). Replica ``r`` of ``N`` runs a step on
``b`` rows of a global batch of ``N*b``: rows ``r*b .. (r+1)*b`` in one process, and with
``tfdp.data``'s DATA sharding over ``W`` workers rows ``w + W*(l*b + j)`` for replica ``l`` of
worker ``w`` (``deal_rows``: the elements are dealt to the workers one by one), and with
TensorFlow's own distribution of a batched dataset over ``W`` workers rows ``(w + W*l)*b + j``
(its per-replica batches are dealt one by one). Inside
``strategy.run`` a draw whose
leading dimension is that per-replica batch ``b`` (Dropout, SpatialDropout, AlphaDropout,
GaussianNoise, GaussianDropout, the random augmentation layers, ``keras.random.*`` drawn
per example in a custom layer) is made at the global batch size ``N*b`` with the same seed,
and each replica keeps its rows: exactly the numbers one device draws for
those examples, so a model with Dropout trains to the weights one device reaches on the same
global batch. A draw whose leading dimension is not the batch (a noise shared by the whole
batch, a ``noise_shape`` whose first entry is 1) stays identical on every replica, which is
again what one device does: it draws it once for the whole batch. ``b`` is the leading
dimension of the first tensor in the arguments of ``strategy.run`` (Keras's ``fit`` passes
the batch); a leading dimension that only equals ``b`` by coincidence is treated as the
batch. The cost: a per-example draw generates ``N`` times the numbers (Dropout masks the
padded global batch), which is elementwise work beside the step's matrix products.

Where there is no batch to go by (``strategy.run`` called without a tensor argument), and
with ``random_draws="independent"``, each replica folds its global replica id into the seed:
draws are independent across replicas and workers and reproducible from the seed, but do
not match one device's. ``keras.random.shuffle`` permutes within a replica's batch (one
device's permutation moves examples across the global batch, which data parallelism cannot).

Mechanism. ``DataParallelStrategy.run`` wraps the replica function so that it knows its
strategy and ``b`` (``replica_function``; ``replica_batch.py`` holds them, sparse gradients
read them too); the Keras TensorFlow backend's draw functions are
patched (``install_keras_hooks``, through ``keras_integration``) to ask for them. Outside a
tfdp replica function, or with one replica, Keras draws exactly as it would without tfdp.
"""

from __future__ import annotations

import functools
import inspect

import tensorflow as tf

from tfdp import _tf_private
from tfdp.strategy import replica_ops
from tfdp.strategy.replica_batch import current as _current
from tfdp.strategy.replica_batch import leading_batch_size
from tfdp.strategy.replica_batch import running as _running

__all__ = ["replica_function", "install_keras_hooks", "leading_batch_size", "deal_rows"]


def replica_function(strategy, fn):
    """``fn`` for ``strategy.run``: converted by AutoGraph as ``Strategy.run`` would, and run
    knowing its strategy and its per-replica batch."""
    converted = _tf_private.convert_like_strategy_run(fn)

    @tf.autograph.experimental.do_not_convert
    def run_replica(*args, **kwargs):
        with _running(strategy, leading_batch_size(args, kwargs)):
            return converted(*args, **kwargs)

    return functools.wraps(fn)(run_replica)


def _seed(seed_argument, strategy, batch):
    """The one seed tensor of this draw; replica-folded where draws are only independent."""
    seed = _tf_private.keras_draw_seed(seed_argument)
    if batch is None or strategy.random_draws == "independent":
        replica = tf.cast(replica_ops.global_replica_id(strategy), seed.dtype)
        seed = seed + tf.stack([tf.zeros_like(replica), (replica + 1) * 7919])
    return _tf_private.drawn_seed(seed)


def deal_rows(strategy, num_pipelines: int, unit: str = "element") -> None:
    """Tells ``strategy`` how its input deals a global batch to the replicas.

    ``unit="element"``: ``tfdp.data``'s DATA policy deals the elements one by one to
    ``num_pipelines`` workers, and each worker's replicas take consecutive batches: replica
    ``l`` of worker ``w`` holds rows ``w + W*(l*b + j)`` of one device's global batch (``W``
    workers, ``b`` per replica). ``unit="batch"``: TensorFlow's own distribution of a batched
    dataset (``experimental_distribute_dataset``, what Keras's ``fit`` does with a
    ``tf.data.Dataset``) splits each global batch into ``N`` per-replica batches and deals them
    to the ``W`` workers one by one: replica ``l`` of worker ``w`` holds rows
    ``(w + W*l)*b + j`` (measured with TF 2.21 on 2 workers x 2 replicas). With one pipeline
    (the default) replica ``r`` holds rows ``r*b .. (r+1)*b``. The newest call wins; a train
    function keeps the layout it was traced with.
    """
    if unit not in ("element", "batch"):
        raise ValueError(f"unit must be 'element' or 'batch', got {unit!r}")
    strategy._tfdp_dealt_to = (max(1, int(num_pipelines)), unit)  # tfdp's own


def _global_rows(strategy, batch):
    """This replica's rows of one device's global batch (an int32 tensor of ``batch`` rows)."""
    dealt_to, unit = getattr(strategy, "_tfdp_dealt_to", (1, "element"))
    rows = tf.range(batch, dtype=tf.int32)
    if dealt_to == 1:
        return tf.cast(replica_ops.global_replica_id(strategy), tf.int32) * batch + rows
    local = tf.cast(replica_ops.local_replica_index(), tf.int32)
    if unit == "batch":
        return (strategy.cluster.rank + dealt_to * local) * batch + rows
    return strategy.cluster.rank + dealt_to * (local * batch + rows)


def _as_one_device(strategy, batch, lead, global_draw, local_draw):
    """This replica's rows of ``global_draw(N*b, rows)`` when ``lead`` is the batch ``b``, else
    ``local_draw()`` (the same on every replica)."""
    if batch is None or strategy.random_draws == "independent":
        return local_draw()

    def draw_rows():
        rows = _global_rows(strategy, batch)
        return tf.gather(global_draw(strategy.num_replicas_in_sync * batch, rows), rows)

    if isinstance(lead, int) and isinstance(batch, int):
        return draw_rows() if lead == batch else local_draw()
    return tf.cond(tf.equal(tf.cast(lead, tf.int32), tf.cast(batch, tf.int32)),
                   draw_rows, local_draw)


def _with_leading(shape, lead):
    """``shape`` (a sequence or a 1-D tensor) with its first entry replaced by ``lead``."""
    if tf.is_tensor(shape):
        return tf.concat([tf.reshape(tf.cast(lead, shape.dtype), [1]), shape[1:]], axis=0)
    return [lead, *list(shape)[1:]]


def _leading(shape):
    """The first entry of ``shape``: an int where static, else a scalar tensor, None for a
    scalar draw."""
    if tf.is_tensor(shape):
        if not shape.shape.rank:
            return None
        static = tf.get_static_value(shape[0])
        return shape[0] if static is None else int(static)
    shape = list(shape)
    if not shape:
        return None
    static = tf.get_static_value(shape[0]) if tf.is_tensor(shape[0]) else shape[0]
    return shape[0] if static is None else int(static)


def _make_shaped(original):
    """A draw ``f(shape, ..., seed=...)`` made per replica as on one device."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def draw(*args, **kwargs):
        here = _current()
        if here is None:
            return original(*args, **kwargs)
        strategy, batch = here
        call = signature.bind(*args, **kwargs)
        call.arguments["seed"] = _seed(call.arguments.get("seed"), strategy, batch)
        shape = call.arguments["shape"]
        lead = _leading(shape)
        if lead is None:  # a scalar draw: shared by the batch
            return original(*call.args, **call.kwargs)

        def global_draw(total, _):
            arguments = dict(call.arguments, shape=_with_leading(shape, total))
            return original(**arguments)

        return _as_one_device(strategy, batch, lead, global_draw,
                              lambda: original(*call.args, **call.kwargs))

    return draw


def _make_input_led(original):
    """A draw ``f(inputs, ..., seed=...)`` that follows ``inputs`` row by row (dropout's mask,
    categorical samples per row of logits), made per replica as on one device."""
    signature = inspect.signature(original)
    first = next(iter(signature.parameters))

    @functools.wraps(original)
    def draw(*args, **kwargs):
        here = _current()
        if here is None:
            return original(*args, **kwargs)
        call = signature.bind(*args, **kwargs)
        rate = call.arguments.get("rate")
        if isinstance(rate, (int, float)) and rate in (0, 1):
            return original(*args, **kwargs)  # Keras draws nothing for these rates
        strategy, batch = here
        call.arguments["seed"] = _seed(call.arguments.get("seed"), strategy, batch)
        inputs = tf.convert_to_tensor(call.arguments[first])
        call.arguments[first] = inputs
        noise_shape = call.arguments.get("noise_shape")
        noise_lead = None if noise_shape is None else list(noise_shape)[0]
        if noise_lead is not None:  # a mask shared along the batch, or a fixed first size
            lead = noise_lead
        else:
            lead = inputs.shape[0] if inputs.shape[0] is not None else tf.shape(inputs)[0]

        def global_draw(total, rows):
            # This replica's inputs at its rows of a global batch (zeros elsewhere): the draw
            # follows the inputs row by row, so its rows are one device's.
            shape = tf.concat([[total], tf.shape(inputs, out_type=tf.int32)[1:]], axis=0)
            arguments = dict(call.arguments)
            arguments[first] = tf.scatter_nd(rows[:, tf.newaxis], inputs, shape)
            if noise_shape is not None:
                arguments["noise_shape"] = [None, *list(noise_shape)[1:]]
            return original(**arguments)

        return _as_one_device(strategy, batch, lead, global_draw,
                              lambda: original(*call.args, **call.kwargs))

    return draw


def install_keras_hooks() -> None:
    """Installs the per-replica draws into Keras's TensorFlow backend (idempotent; called by
    ``keras_integration.install``). Outside a tfdp replica function nothing changes."""
    _tf_private.patch_keras_random(_make_shaped, _make_input_led)
