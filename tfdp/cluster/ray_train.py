"""Ray Train's ``TF_CONFIG`` -> addresses on 127.0.0.1 when every worker is on this host.
Pure Python: no TensorFlow, and Ray only where the process already imported it.

Rule: ``ray.train.tensorflow.TensorflowTrainer`` gives each worker a worker-only ``TF_CONFIG``
(``tfdp.cluster.tf_config`` parses it) whose hosts are the workers' Ray node IPs,
``ray.util.get_node_ip_address()``. Ray turns a loopback node address into the host's
external one (``ray.init(_node_ip_address="127.0.0.1")`` and ``ray start --head
--node-ip-address=127.0.0.1`` both run with the address of the host's external interface), so
a Ray started on loopback still names that interface in ``TF_CONFIG``. So, in a process where
Ray is initialised (a Ray Train worker): **when every worker's host in a worker-only layout is
this process's own Ray node IP, every worker runs on this host, and tfdp addresses them as
127.0.0.1 with Ray's ports.** That is always the case for a Ray on loopback, and for any
one-node Ray cluster. Workers on several nodes keep Ray's addresses; a ``chief`` entry (not
Ray's layout) or a process without Ray is left alone. A TensorFlow server listens on every
interface, so 127.0.0.1 reaches a worker wherever Ray's address would have.
"""

from __future__ import annotations

import sys

from tfdp.cluster.layout import Layout

__all__ = ["LOOPBACK", "node_ip_address", "on_loopback", "loopback_if_one_host"]

LOOPBACK = "127.0.0.1"
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def node_ip_address() -> str | None:
    """This process's Ray node IP, or None outside an initialised Ray (never imports Ray)."""
    ray = sys.modules.get("ray")
    if ray is None or not getattr(ray, "is_initialized", lambda: False)():
        return None
    try:
        import ray.util  # a submodule of an already imported package

        return ray.util.get_node_ip_address()
    except Exception:  # an unusual Ray: its addresses as they are
        return None


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def on_loopback(layout: Layout, node_ip: str | None) -> Layout:
    """``layout`` with 127.0.0.1 for every host when all of them are ``node_ip``; else as is.

    Args:
        layout: a parsed ``TF_CONFIG``.
        node_ip: this process's Ray node IP (None: not in Ray, nothing changes).

    Example: ``{"worker": ["10.0.0.5:4001", "10.0.0.5:4002"]}`` with ``node_ip="10.0.0.5"``
    becomes ``["127.0.0.1:4001", "127.0.0.1:4002"]``; with a worker on 10.0.0.6 it stays.
    """
    spec = layout.cluster_spec
    if not node_ip or set(spec) != {"worker"}:
        return layout
    hosts = {_host(address) for address in spec["worker"]}
    if hosts != {node_ip.strip("[]")} or node_ip in _LOOPBACK_HOSTS:
        return layout
    workers = tuple(f"{LOOPBACK}:{address.rpartition(':')[2]}" for address in spec["worker"])
    note = (f"Ray Train: every worker on this node ({node_ip}), so addressed on {LOOPBACK} "
            "(tfdp.cluster.ray_train)")
    return Layout(workers=workers, task_type=layout.task_type, task_index=layout.task_index,
                  cluster_spec={"worker": workers}, source=layout.source,
                  task_gpus=layout.task_gpus, notes=layout.notes + (note,))


def loopback_if_one_host(layout: Layout) -> Layout:
    """:func:`on_loopback` with this process's Ray node IP (unchanged outside Ray)."""
    if set(layout.cluster_spec) != {"worker"}:
        return layout  # not Ray Train's layout: no need to look for Ray
    return on_loopback(layout, node_ip_address())
