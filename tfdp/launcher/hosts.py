"""tfdp-run's hosts: ``--hosts``/``--hostfile`` and the addresses workers are reached at. Pure.

No processes and no network: these functions turn the command line into a list of
:class:`Host` and the slots placed on them, so they are tested without ssh.

Rule. ``--hosts a:2,b:2`` (or a hostfile with ``a slots=2`` and ``b slots=2``, the format of
Horovod's and DeepSpeed's users) places slots 0 and 1 on host ``a`` and slots 2 and 3 on ``b``:
hosts in the order given, each host's slots consecutive. A slot keeps its host across restarts,
so dropping a host drops its slots. The names ``localhost`` and ``127.0.0.1`` run their workers
on this machine without ssh; every other name is reached with ``ssh NAME``.

Each worker's TensorFlow server listens on every interface of its host; what matters is the
address its peers dial, written in ``TF_CONFIG``. It is, in this order: ``--address
HOST=ADDR``; the IPv4 address of ``--network-interface IFACE`` (all hosts) or
``--network-interface HOST=IFACE`` (one host), looked up on that host when the job starts; else
the host name as given (peers must resolve it).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Optional, Sequence

__all__ = ["Host", "HostsError", "LOCAL_NAMES", "parse_hosts", "parse_hostfile",
           "with_addresses", "slot_hosts", "ranks_by_host"]

LOCAL_NAMES = ("localhost", "127.0.0.1")


class HostsError(ValueError):
    """A malformed ``--hosts``, hostfile, ``--address`` or ``--network-interface``."""


@dataclasses.dataclass(frozen=True)
class Host:
    """A machine tfdp-run starts workers on.

    Args:
        name: what ``ssh`` is given (``user@name`` works too); ``localhost`` or ``127.0.0.1``:
            this machine, no ssh.
        slots: how many workers it runs.
        address: what its workers' peers dial (``--address``); None: the interface's address,
            else ``name`` without any ``user@``.
        interface: the network interface whose IPv4 address is the address
            (``--network-interface``), looked up on the host.
    """

    name: str
    slots: int = 1
    address: Optional[str] = None
    interface: Optional[str] = None

    @property
    def is_local(self) -> bool:
        return self.name in LOCAL_NAMES

    @property
    def default_address(self) -> str:
        return self.address or self.name.rpartition("@")[2]

    def get_config(self) -> dict:
        return dataclasses.asdict(self)


def _host(name: str, slots: int, where: str) -> Host:
    if not name or any(c.isspace() for c in name) or name.startswith("-"):
        raise HostsError(f"{where}: {name!r} is not a host name")
    if slots < 1:
        raise HostsError(f"{where}: host {name} has {slots} slots; give at least 1")
    return Host(name, slots)


def _checked(hosts: list, where: str) -> list:
    if not hosts:
        raise HostsError(f"{where}: no host given")
    seen = set()
    for h in hosts:
        if h.name in seen:
            raise HostsError(f"{where}: host {h.name} is listed twice; list it once with all "
                             "its slots")
        seen.add(h.name)
    return hosts


def parse_hosts(text: str) -> list:
    """``"a:2,b:2"`` -> [Host("a", 2), Host("b", 2)]; a name without ``:N`` has one slot."""
    hosts = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, sep, count = item.rpartition(":")
        if not sep:
            name, count = item, "1"
        if not count.isdigit():
            raise HostsError(f"--hosts {text}: {item!r} must be HOST or HOST:SLOTS, e.g. a:2")
        hosts.append(_host(name, int(count), f"--hosts {text}"))
    return _checked(hosts, f"--hosts {text}")


def parse_hostfile(text: str, path: str = "hostfile") -> list:
    """Lines ``host slots=N`` (``slots=N`` optional: 1); ``#`` comments and blank lines allowed."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *rest = line.split()
        slots = 1
        for field in rest:
            key, sep, value = field.partition("=")
            if key == "slots" and sep and value.isdigit():
                slots = int(value)
            elif key not in ("max_slots", "max-slots"):  # OpenMPI's, ignored
                raise HostsError(f"{path}:{number}: {raw.strip()!r}: expected 'HOST slots=N'")
        hosts.append(_host(name, slots, f"{path}:{number}"))
    return _checked(hosts, path)


def _pairs(values: Iterable[str], flag: str) -> dict:
    pairs = {}
    for value in values:
        key, sep, item = value.partition("=")
        if not sep or not key or not item:
            raise HostsError(f"{flag} {value}: expected HOST=VALUE")
        pairs[key] = item
    return pairs


def with_addresses(hosts: Sequence[Host], addresses: Iterable[str] = (),
                   interfaces: Iterable[str] = ()) -> list:
    """Applies ``--address HOST=ADDR`` and ``--network-interface [HOST=]IFACE`` to ``hosts``.

    A mix of this machine and other hosts needs this machine's address: its peers on other
    hosts cannot dial ``localhost``.
    """
    names = {h.name for h in hosts}
    by_host = _pairs(addresses, "--address")
    every, per_host = None, {}
    for value in interfaces:
        if "=" in value:
            per_host.update(_pairs([value], "--network-interface"))
        else:
            every = value
    for flag, given in (("--address", by_host), ("--network-interface", per_host)):
        for name in given:
            if name not in names:
                raise HostsError(f"{flag} {name}={given[name]}: {name} is not one of the hosts "
                                 f"{sorted(names)}")
    placed = [dataclasses.replace(h, address=by_host.get(h.name),
                                  interface=None if h.name in by_host
                                  else per_host.get(h.name, every)) for h in hosts]
    if any(not h.is_local for h in placed):
        for h in placed:
            if h.is_local and h.address is None and h.interface is None:
                raise HostsError(
                    f"host {h.name} runs on this machine, but the workers on the other hosts "
                    f"cannot reach it as {h.name!r}: give --address {h.name}=<this machine's "
                    "address> or --network-interface, or list this machine by its name")
    return placed


def slot_hosts(hosts: Sequence[Host]) -> list:
    """The host of every slot: hosts in order, each host's slots consecutive."""
    return [h for h in hosts for _ in range(h.slots)]


def ranks_by_host(hosts_of_ranks: Sequence[Host]) -> Mapping[Host, list]:
    """{host: its ranks, ascending}, hosts in order of their first rank."""
    grouped: dict = {}
    for rank, host in enumerate(hosts_of_ranks):
        grouped.setdefault(host, []).append(rank)
    return grouped
