"""The leaf every cluster parser shares: the error, addresses, ports. Pure Python.

Rule: every malformed or unsupported layout is a :class:`ClusterConfigError` whose message
names where the value came from, the field, the value, the problem and the fix
(``"<origin> <field>=<value>: <problem>. Fix: <fix>."``), so a user fixes it without reading
tfdp's source. This module imports nothing from tfdp but ``tfdp.protocol``, so every other
module of ``tfdp.cluster`` can import it and none can be imported back by it.
"""

from __future__ import annotations

from typing import Any, Mapping

from tfdp.protocol import PORT_BASE_ENV

__all__ = ["ClusterConfigError", "fail", "parse_address", "DEFAULT_PORT_BASE", "port_base"]

# Below Linux's ephemeral port range (32768-60999): no outgoing connection holds these.
DEFAULT_PORT_BASE = 20000


class ClusterConfigError(ValueError):
    """A malformed or unsupported cluster description; names the field, value and fix."""


def fail(origin: str, field: str, value: Any, problem: str, fix: str) -> ClusterConfigError:
    """The error for ``field`` of ``origin`` (returned, not raised: ``raise fail(...)``)."""
    return ClusterConfigError(f"{origin} {field}={value!r}: {problem}. Fix: {fix}.")


def parse_address(origin: str, field: str, address: Any) -> str:
    """``address`` unchanged if it is ``host:port`` with a port from 1 to 65535."""
    if not isinstance(address, str) or not address:
        raise fail(origin, field, address, "an address must be a non-empty 'host:port' string",
                   "write each address as \"host:port\", e.g. \"10.0.0.2:2222\"")
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise fail(origin, field, address, "the address has no ':port' part",
                   "write it as \"host:port\", e.g. \"10.0.0.2:2222\"")
    if not port.isdigit():
        raise fail(origin, field, address, f"the port {port!r} is not a number",
                   "use a decimal port between 1 and 65535")
    if not 0 < int(port) < 65536:
        raise fail(origin, field, address, f"the port {port} is out of range",
                   "use a port between 1 and 65535")
    return address


def port_base(environ: Mapping[str, str], default: int = DEFAULT_PORT_BASE, span: int = 1) -> int:
    """``TFDP_PORT_BASE`` if set (checked: ``span`` ports from it must exist), else ``default``."""
    text = environ.get(PORT_BASE_ENV, "").strip()
    if not text:
        return default
    if not text.isdigit() or not 1024 <= int(text) <= 65536 - span:
        raise ClusterConfigError(
            f"{PORT_BASE_ENV}={text!r}: not a port from 1024 to {65536 - span}. Fix: give the "
            f"first of {span} free port(s), e.g. {PORT_BASE_ENV}={DEFAULT_PORT_BASE}.")
    return int(text)
