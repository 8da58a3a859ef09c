"""TensorFlow's profiler trace format: reading a ``.xplane.pb`` offline.

Why: ``tf.profiler.experimental.start``/``stop`` write a trace as an XSpace protocol buffer
(``<logdir>/plugins/profile/<run>/<host>.xplane.pb``); TensorBoard reads it through its
profile plugin, which tensorflow-cpu does not install and which converts it in a server.
tools/profile_step.py (issue 43: when each gradient bucket's collective runs against the
backward pass) reads the events itself; the message class ships with TensorFlow only under
its private ``tsl`` package. tests/test_tf_private.py pins it.
"""

from __future__ import annotations


def xspace_proto():
    """The XSpace message class (planes -> lines (threads) -> events, in picoseconds)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    return xplane_pb2.XSpace
