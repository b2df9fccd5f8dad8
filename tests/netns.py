"""Several hosts on one machine: Linux network namespaces on a private bridge.

Each host is a namespace with one veth link to a bridge in the root namespace and
an address of its own on a private /24 that ``Hosts`` picks (one no interface of
this machine uses). The bridge holds ``.1``, so the test process itself reaches
every host; nothing else is routed. ``cut``/``mend`` take a host's link down and
up (its packets are dropped, as when a machine drops off the network).
``close`` removes every namespace, link and the bridge; names carry a random
prefix so that concurrent runs never collide. Needs root and iproute2.
"""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field


def unavailable() -> str | None:
    """Why namespaces cannot be built here, or None."""
    if shutil.which("ip") is None:
        return "needs iproute2 (the `ip` command): apt-get install iproute2"
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    probe = f"bgprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def _free_subnet() -> ipaddress.IPv4Network:
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    for _ in range(100):
        net = ipaddress.IPv4Network(f"10.{random.randint(160, 250)}.{random.randint(0, 255)}.0/24")
        if f" 10.{net.network_address.packed[1]}.{net.network_address.packed[2]}." not in used:
            return net
    raise RuntimeError("no free private /24 under 10.160-250")


@dataclass
class Hosts:
    tag: str = field(default_factory=lambda: f"bgf{secrets.token_hex(3)}")  # <= 15 chars
    subnet: ipaddress.IPv4Network = field(default_factory=_free_subnet)
    addresses: dict[str, str] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)  # host -> its veth's root-side end
    bridge_up: bool = False

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def gateway(self) -> str:
        return str(self.subnet.network_address + 1)

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def start(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.bridge_up = True
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add(self, host: str) -> str:
        """A new host on the bridge; its address."""
        k = len(self.addresses)
        ns, outside, inside = self.namespace(host), f"{self.tag}h{k}", f"{self.tag}n{k}"
        address = str(self.subnet.network_address + 2 + k)
        _ip("netns", "add", ns)
        self.addresses[host] = address
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        self.links[host] = outside
        _ip("link", "set", inside, "netns", ns)
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inside)
        _ip("-n", ns, "link", "set", inside, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        return address

    def exec(self, host: str) -> list[str]:
        """The command prefix that runs a program on ``host``."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def cut(self, host: str) -> None:
        _ip("link", "set", self.links[host], "down")

    def mend(self, host: str) -> None:
        _ip("link", "set", self.links[host], "up")

    def close(self) -> list[str]:
        """Remove every link, namespace and the bridge (each step tried, whatever failed
        before); the names with this run's tag still on the machine (none, normally)."""
        for host in list(self.addresses):
            if host in self.links:
                subprocess.run(["ip", "link", "del", self.links[host]], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.namespace(host)], capture_output=True)
        self.addresses.clear()
        self.links.clear()
        if self.bridge_up:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            self.bridge_up = False
        return self.leftovers()

    def leftovers(self) -> list[str]:
        """Namespaces and links with this run's tag still on the machine."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        return [w.split("@")[0].rstrip(":") for w in (names + links).split()
                if w.startswith(self.tag)]  # fmt: skip
