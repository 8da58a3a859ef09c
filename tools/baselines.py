"""TensorFlow's own strategies as benchmark baselines (shared by tools/bench_step.py and
tools/bench_multiworker_step.py)."""

from __future__ import annotations


def patched_mwms(tf, local_cpus=1):
    """MultiWorkerMirroredStrategy with TF_NOTES.md's Keras-3 fixes (reduce mapped over
    nests, axis=None for scalars); with ``local_cpus`` > 1 its extended object uses that many
    logical CPUs (the hook tfdp overrides too, pinned in tests/test_tf_private.py)."""
    from tfdp import _tf_private

    class LocalCPUs(_tf_private.CollectiveAllReduceExtended):
        def _initialize_local_devices(self, cluster_resolver, worker_device):
            return tuple(f"{worker_device}/device:CPU:{i}" for i in range(local_cpus)), "CPU"

    class PatchedMWMS(tf.distribute.MultiWorkerMirroredStrategy):
        def __init__(self):
            if local_cpus == 1:
                super().__init__()
                return
            resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
            _tf_private.StrategyBase.__init__(self, LocalCPUs(
                self, cluster_resolver=resolver,
                communication_options=tf.distribute.experimental.CommunicationOptions()))

        def reduce(self, reduce_op, value, axis=None):
            flat = tf.nest.flatten(value)
            if len(flat) != 1 or flat[0] is not value:
                return tf.nest.map_structure(lambda v: self.reduce(reduce_op, v, axis), value)
            if axis is not None and all(p.shape.rank == 0 for p in self.experimental_local_results(value)):
                axis = None
            return super().reduce(reduce_op, value, axis)

    return PatchedMWMS()
