"""SageMaker's ``SM_HOSTS`` + ``SM_CURRENT_HOST`` -> a :class:`~tfdp.cluster.layout.Layout`.
Pure Python.

Rule: every host of ``SM_HOSTS`` (a JSON list, e.g. ``["algo-1", "algo-2"]``) is a worker;
a host's rank is its position in that list, its port ``TFDP_PORT_BASE`` (default 20000) +
rank. This process is the host named by ``SM_CURRENT_HOST``. A list that is empty, holds a
non-string or blank name, or names a host twice is refused, as is a current host not in it.
SageMaker's multi-worker mirrored mode writes ``TF_CONFIG`` too, which wins over this.
"""

from __future__ import annotations

import json
from typing import Mapping

from tfdp.cluster.errors import fail, port_base
from tfdp.cluster.layout import Layout

__all__ = ["ORIGIN", "parse"]

ORIGIN = "SM_HOSTS"
_FIX = 'pass SageMaker\'s value unchanged, e.g. ["algo-1", "algo-2"]'


def parse(environ: Mapping[str, str]) -> Layout:
    """The workers of ``SM_HOSTS`` and this host's rank among them (see the module docstring)."""
    try:
        hosts = json.loads(environ.get("SM_HOSTS", ""))
    except ValueError as e:
        raise fail(ORIGIN, "(whole value)", environ.get("SM_HOSTS"), f"not valid JSON ({e})",
                   _FIX) from None
    if (not isinstance(hosts, list) or not hosts
            or not all(isinstance(h, str) and h.strip() for h in hosts)):
        raise fail(ORIGIN, "(whole value)", hosts, "must be a non-empty list of host names", _FIX)
    if len(set(hosts)) != len(hosts):
        raise fail(ORIGIN, "(whole value)", hosts, "a host appears twice", "list every host once")
    current = environ.get("SM_CURRENT_HOST", "")
    if current not in hosts:
        raise fail("SM_CURRENT_HOST", "(whole value)", current, f"not one of SM_HOSTS {hosts}",
                   "pass SageMaker's values unchanged")
    base = port_base(environ, span=len(hosts))
    return Layout.of_workers([f"{host}:{base + i}" for i, host in enumerate(hosts)],
                             hosts.index(current), ORIGIN)
