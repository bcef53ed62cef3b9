"""WAN emulation: one network namespace per site, every pair of sites joined by its own shaped veth pair.

    with WanLink(name_prefix=f"nbt{os.getpid()}", rate_mbit=20, sites=("a", "b", "c")) as link:
        argv = (*link.exec_prefix("c"), sys.executable, "-m", "some.service", ...)  # runs in ns c
        Supervisor().start(ServiceSpec(name="server", argv=argv, run=RUN))  # nebula.site's supervisor
        server_address = link.address("c", peer="a")                 # where site a reaches site c
        print(measure_goodput(link, 4_000_000, src="a", dst="c"))    # Mbit/s of TCP payload, a -> c

The sites form a full mesh of point-to-point links (default: sites a and b, one link):
- namespace `<prefix>-<site>` per site; it holds `lo` and one veth end per peer, named `wan-<peer>`
  (in namespace `<prefix>-a`, `wan-b` leads to site b). Both ends are created directly inside their
  namespaces, so nothing appears (or collides) in the host namespace. The prefix names one mesh:
  `up()` refuses while any `<prefix>-<site>` namespace exists; it first removes the meshes of benches
  killed with SIGKILL (`remove_orphans`: named after a process that is gone, nothing of anyone's running in them).
- each pair takes the next /30 of `subnet`, in the order of itertools.combinations(sites, 2); the
  first site of the pair gets host 1, the other host 2. With the default subnet 10.213.0.0/24, sites
  a and b are 10.213.0.1 and 10.213.0.2, and with a third site c the links a-c and b-c are
  10.213.0.4/30 and 10.213.0.8/30. The addresses exist only inside the namespaces, and no namespace
  forwards, so a link carries only the traffic of its two sites.
- site names are 1-11 lowercase letters or digits: `wan-<site>` must fit Linux's 15-character
  interface names, and with no '-' in a site name `<prefix>-<site>` reads back unambiguously. With
  a prefix of at most 41 characters a namespace name is at most 53, far below the 255 that
  `ip netns` (a file name) allows.

Every link is shaped exactly as a single two-site link always was: each end shapes what it sends
with the tbf and small-packet priority below, so each pair is limited to the rate in each direction,
independently of the other pairs. tbf parameters, measured on this host (kernel 6.18, HZ=250, 2 busy
shared cores; docs/wan.md has the tables): a single TCP stream carries 1448 payload bytes per
1514-byte frame that tbf counts, so 95.6% of the shaped rate is the ceiling, and that is what we
reach at 10, 60 and 170 Mbit/s.
- burst = max(rate x 4 ms, 10 frames). tbf refills its bucket from a timer; on a busy host the
  dequeue runs late, and tokens beyond `burst` are thrown away. A 1-2 frame burst lost 5-10% of the
  rate at 60-170 Mbit/s; one tick (4 ms at HZ=250) of rate held the ceiling. The 10-frame floor
  gives low rates the same slack (4 ms at 10 Mbit/s is only 3 frames).
- limit (queue) = burst + max(50 ms at the rate, 256 KiB). At 60-170 Mbit/s, 5 ms of queue lost
  packets on every transfer and 50 ms lost none. At 10 Mbit/s 50 ms is only 62 KB, less than the
  bursts a single socket puts in the qdisc (a 64 KB GSO packet alone), and bbr (this host's
  default) lost ~1 frame in 3; a 256 KiB floor (210 ms at 10 Mbit/s) lost none. Tens to hundreds
  of ms of queueing under a saturating transfer is also what real WAN links show.
- Small packets first: inside tbf, an HTB with two classes serves TCP packets under 128 bytes (pure
  ACKs) before bulk data. With both directions saturated (activations one way, gradients back) a
  FIFO made ACKs wait behind the other direction's data: at 0.5 Mbit/s one direction fell to 0.62
  of the rate; with the priority both directions keep 0.95-0.99 (60 Mbit/s: 0.94 both ways).
- Offloads stay on: tbf cuts GSO super-packets larger than `burst` into frames before queueing
  them, and turning gso/tso/gro off (ethtool) gained nothing measurable while costing CPU.
Propagation delay (`rtt_ms`): netem is missing from this kernel, so each end of a link sends what
it sends to the peer through a user-space delay line (nebula_lab/delayline.py) that holds every packet
rtt_ms / 2 before it enters the tbf: in a site's namespace a /32 route to the peer's address leads
into the TUN device `dly-<peer>`, and the `python -m nebula_lab.delayline` process reading it sends each
packet out of `wan-<peer>` rtt_ms / 2 later. docs/wan.md has the measurements.
"""
from __future__ import annotations

import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nebula.errors import ConfigError, NebulaError, StageError
from nebula.site.process import cmdline
from nebula.site.service import ServiceSpec
from nebula.site.supervisor import Supervisor, detach

DEFAULT_SITES = ("a", "b")
DEFAULT_SUBNET = "10.213.0.0/24"  # 64 links: up to 11 sites; its first /30 is the two-site link
DEVICE_PREFIX = "wan-"  # in a site's namespace, the end of its link to `peer` is `wan-<peer>`
DELAY_PREFIX = "dly-"  # ... and with a delay, the TUN device its delay line reads is `dly-<peer>`
DELAY_MODULE = "nebula_lab.delayline"
MAX_RTT_MS = 10_000.0
LINK_PREFIXLEN = 30  # each link: a /30, its two hosts the two ends
FRAME_BYTES = 1514  # what tbf counts for a full-size frame: 1500 MTU + 14 Ethernet header
TICK_S = 0.004  # one kernel tick at HZ=250
QUEUE_S = 0.050  # queue, as time at the link rate...
QUEUE_MIN_BYTES = 256 * 1024  # ...but never shorter than this (see the module docstring)
SMALL_PACKET_CLASSES = ("10:10", "10:20")  # HTB classes inside tbf: small TCP packets first, then the rest
BLACKHOLE_MAC = "02:00:00:00:de:ad"  # WanLink.cut: locally administered, on no interface
_PREFIX_RE = re.compile(r"[a-z][a-z0-9_-]{0,40}")
_SITE_RE = re.compile(r"[a-z0-9]{1,11}")  # 4 + 11 = 15 characters, Linux's longest interface name


class WanError(NebulaError):
    """The WAN emulation cannot be set up, used or torn down on this host."""


def tbf_burst_bytes(rate_mbit: float) -> int:
    """Bucket size: one timer tick of tokens, at least ten full frames (see the module docstring)."""
    return max(int(rate_mbit * 1e6 / 8 * TICK_S), 10 * FRAME_BYTES)


def tbf_limit_bytes(rate_mbit: float) -> int:
    """Queue size in bytes, counted the way tbf does (burst included)."""
    return tbf_burst_bytes(rate_mbit) + max(int(rate_mbit * 1e6 / 8 * QUEUE_S), QUEUE_MIN_BYTES)


class WanLink:
    """One namespace per site and a shaped veth pair between every two sites; a context manager that
    always cleans up.

    `up()` leaves the mesh in place (for `nebula wan up`); `down()` removes this handle's namespaces
    (and with them every link) and is safe to call when they are already gone.
    """

    def __init__(self, name_prefix: str = "nebula", rate_mbit: float = 60.0,
                 subnet: str = DEFAULT_SUBNET, sites: tuple[str, ...] = DEFAULT_SITES, rtt_ms: float = 0.0):
        if not _PREFIX_RE.fullmatch(name_prefix):
            raise ConfigError(f"WAN name prefix {name_prefix!r} is invalid: use 1-41 lowercase "
                              "letters, digits, '-' or '_', starting with a letter")
        if not 0.1 <= rate_mbit <= 10_000:
            raise ConfigError(f"WAN rate {rate_mbit} Mbit/s is out of range: use 0.1 to 10000")
        if not 0 <= rtt_ms <= MAX_RTT_MS:
            raise ConfigError(f"WAN round-trip delay {rtt_ms} ms is out of range: use 0 (none) to {MAX_RTT_MS:g}")
        self.prefix = name_prefix
        self.rate_mbit = float(rate_mbit)
        self.rtt_ms = float(rtt_ms)  # added propagation delay, rtt_ms / 2 each way; 0: none
        self._delay_procs: list[subprocess.Popen] = []
        self.sites = _check_sites(sites)
        self.pairs = tuple(itertools.combinations(self.sites, 2))  # one link each
        self._addresses = _link_addresses(self.pairs, subnet)
        self.subnet = subnet

    @classmethod
    def attach(cls, name_prefix: str) -> WanLink:
        """A handle on a mesh that is already up (e.g. from `nebula wan up`): its sites, in the order
        they were given, its rate and the smallest subnet that holds its links, all read back."""
        check_host()
        sites = sites_up(name_prefix)
        status = mesh_status(name_prefix, sites)
        if len(sites) < 2 or not all(_is_complete(info) for info in status.values()):
            raise WanError(f"WAN link {name_prefix} is not up: run `nebula wan up --prefix {name_prefix}`")
        order, subnet = _layout(status)
        unknown = WanError(f"WAN mesh {name_prefix} is not laid out as `nebula wan up` lays it out: run "
                           f"`nebula wan down --prefix {name_prefix}` and bring it up again")
        try:
            delays = {end["delay_ms"] for site in sites for end in status[site]["links"].values()}
            rtt_ms = 2 * delays.pop() if len(delays) == 1 and None not in delays else 0.0
            link = cls(name_prefix, status[sites[0]]["qdisc"]["rate_mbit"], subnet, order, rtt_ms)
        except ConfigError as exc:  # e.g. an address that is neither host of its /30
            raise unknown from exc
        if link._addresses != {(site, peer): end["address"] for site in sites
                               for peer, end in status[site]["links"].items()}:
            raise unknown
        return link

    # --- naming -------------------------------------------------------------------------
    def namespace(self, site: str) -> str:
        return f"{self.prefix}-{self._check_site(site)}"

    def address(self, site: str, peer: str | None = None) -> str:
        """The site's address on its link to `peer`: where `peer` connects to reach `site`.
        `peer` may be left out when there are two sites."""
        return self._addresses[self._ends(site, peer)]

    def device(self, site: str, peer: str | None = None) -> str:
        """The name, inside the site's namespace, of its end of the link to `peer`."""
        return DEVICE_PREFIX + self._ends(site, peer)[1]

    def peers(self, site: str) -> list[str]:
        return [peer for peer in self.sites if peer != self._check_site(site)]

    def exec_prefix(self, site: str) -> list[str]:
        """argv prefix that runs a command inside the site's namespace."""
        return ["ip", "netns", "exec", self.namespace(site)]

    def run(self, site: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Runs `argv` inside the site's namespace to completion; kwargs go to subprocess.run."""
        return subprocess.run([*self.exec_prefix(site), *argv], **kwargs)

    # --- one address per site (torch.distributed peers) --------------------------------------
    def home(self, site: str) -> tuple[str, str]:
        """(the one address a process at `site` is reached at, its device): its end of its link to the
        first other site. gloo gives each rank one address and every pair of ranks connects."""
        peer = self.peers(site)[0]
        return self.address(site, peer), self.device(site, peer)

    def route_homes(self) -> None:
        """Every site reaches every other's home over their direct link (a /32 route where the home is not
        on that link, through the delay line where the mesh has one), so each pair's traffic stays on its
        own shaped link, as gateway-to-gateway traffic does."""
        for site in self.sites:
            for other in self.peers(site):
                far, _ = self.home(other)
                if far == self.address(other, site):
                    continue  # on-link already: their link's /30
                via = DELAY_PREFIX + other if self.rtt_ms else self.device(site, other)
                _ip("-n", self.namespace(site), "route", "add", f"{far}/32", "dev", via, "src",
                    self.address(site, other))

    def _check_site(self, site: str) -> str:
        if site not in self.sites:
            raise ConfigError(f"unknown WAN site {site!r}: use one of {', '.join(self.sites)}")
        return site

    def _ends(self, site: str, peer: str | None) -> tuple[str, str]:
        if peer is None:
            if len(self.sites) != 2:
                raise ConfigError(f"the WAN has sites {', '.join(self.sites)}: name the peer, e.g. "
                                  f"address({site!r}, peer={self.peers(site)[0]!r})")
            return site, self.peers(site)[0]
        if self._check_site(peer) == self._check_site(site):
            raise ConfigError(f"WAN site {site!r} has no link to itself: name another site as the peer")
        return site, peer

    # --- lifecycle ------------------------------------------------------------------------
    def exists(self) -> list[str]:
        """Names of this handle's site namespaces that currently exist."""
        present = set(_existing_namespaces())
        return [self.namespace(s) for s in self.sites if self.namespace(s) in present]

    def up(self) -> WanLink:
        check_host()
        remove_orphans()
        if taken := [f"{self.prefix}-{site}" for site in sites_up(self.prefix)]:
            raise WanError(f"network namespace(s) {', '.join(taken)} already exist: run "
                           f"`nebula wan down --prefix {self.prefix}` first, or pick another prefix")
        created: list[str] = []
        try:
            self._create(created)
        except BaseException:
            for name in created:  # leave nothing half-built, and never touch what we did not make
                _stop_delay_lines(name)
                _ip("netns", "delete", name)
            raise
        return self

    def down(self) -> None:
        for name in self.exists():
            _stop_delay_lines(name)  # a process in a namespace keeps it (and its links) alive
            _ip("netns", "delete", name)  # deleting a namespace destroys its ends of the links too
        for proc in self._delay_procs:
            proc.wait()
        self._delay_procs.clear()

    def __enter__(self) -> WanLink:
        return self.up()

    def __exit__(self, *exc_info) -> None:
        self.down()

    def _create(self, created: list[str]) -> None:
        for site in self.sites:
            _ip("netns", "add", self.namespace(site))
            created.append(self.namespace(site))
        for site, peer in self.pairs:
            _ip("-n", self.namespace(site), "link", "add", self.device(site, peer), "type", "veth",
                "peer", "name", self.device(peer, site), "netns", self.namespace(peer))
        for site in self.sites:
            _ip("-n", self.namespace(site), "link", "set", "lo", "up")
            for peer in self.peers(site):
                self._shape(site, peer)
                if self.rtt_ms:
                    self._delay(site, peer)

    def _shape(self, site: str, peer: str) -> None:
        """Address and shape the site's end of its link to `peer`: each end shapes what it sends, so
        both directions are limited to the rate."""
        ns, dev = self.namespace(site), self.device(site, peer)
        _ip("-n", ns, "addr", "add", f"{self.address(site, peer)}/{LINK_PREFIXLEN}", "dev", dev)
        _ip("-n", ns, "link", "set", dev, "up")
        shape(ns, dev, self.rate_mbit)

    def set_rate(self, rate_mbit: float) -> None:
        """Every link to `rate_mbit` now, with the traffic on it (the WAN's capacity changing under a
        running job): tbf's rate, bucket and queue, and the queues of the small-packet classes inside
        it. The connections stay up; what is queued beyond the new, shorter queue is dropped, as a
        router that shrinks its buffer would, and TCP sends it again."""
        if not 0.1 <= rate_mbit <= 10_000:
            raise ConfigError(f"WAN rate {rate_mbit} Mbit/s is out of range: use 0.1 to 10000")
        check_host()
        limit = tbf_limit_bytes(rate_mbit)
        for site in self.sites:
            for peer in self.peers(site):
                tc = ["tc", "-n", self.namespace(site)]
                dev = self.device(site, peer)
                _run([*tc, "qdisc", "change", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{rate_mbit}mbit",
                      "burst", str(tbf_burst_bytes(rate_mbit)), "limit", str(limit)])
                for classid in SMALL_PACKET_CLASSES:
                    _run([*tc, "qdisc", "replace", "dev", dev, "parent", classid, "bfifo", "limit", str(limit)])
        self.rate_mbit = float(rate_mbit)

    def _delay(self, site: str, peer: str) -> None:
        """Route what the site sends to `peer` through a delay line of rtt_ms / 2 (nebula_lab/delayline.py).
        The TUN device is persistent: should its process die, the route still leads into it and the
        link goes silent, rather than quietly losing its delay."""
        ns, tun, far = self.namespace(site), DELAY_PREFIX + peer, self.address(peer, site)
        _ip("-n", ns, "tuntap", "add", "dev", tun, "mode", "tun")
        _ip("-n", ns, "link", "set", tun, "up")
        argv = (*self.exec_prefix(site), sys.executable, "-m", DELAY_MODULE, tun, self.device(site, peer), far,
                repr(self.rtt_ms / 2000))
        spec = ServiceSpec(name=f"delay-{peer}", run=_delay_run(ns), argv=argv, ready="ready")
        try:
            self._delay_procs.append(detach(spec, f"delay line {site} -> {peer}", timeout=30))
        except ConfigError as exc:
            raise WanError(str(exc)) from exc
        _ip("-n", ns, "route", "add", f"{far}/32", "dev", tun, "src", self.address(site, peer))

    # --- outages --------------------------------------------------------------------------
    def cut(self, site: str | None = None, peer: str | None = None) -> None:
        """The link between `site` and `peer` (default: every link) silently loses every packet, both
        ways, as a WAN cut far from either site does: interfaces, addresses and routes stay up, so
        the hosts learn of it only from silence (TCP retransmits, heartbeats), never from an error.

        Each end's neighbour entry for the other is pinned to a MAC no interface has (BLACKHOLE_MAC):
        frames still leave through tbf, and the far veth drops them as addressed to another host.
        (This kernel has no netem, gact or matchall, and no nft/iptables is installed.)"""
        for one, other in self._cut_pairs(site, peer):
            for end, far in ((one, other), (other, one)):
                _ip("-n", self.namespace(end), "neigh", "replace", self.address(far, end), "dev",
                    self.device(end, far), "lladdr", BLACKHOLE_MAC, "nud", "permanent")

    def restore(self, site: str | None = None, peer: str | None = None) -> None:
        """Ends a cut: the pinned neighbour entries go, ARP finds the real ends again at the next packet."""
        for one, other in self._cut_pairs(site, peer):
            for end, far in ((one, other), (other, one)):
                if self.is_cut(end, far):
                    _ip("-n", self.namespace(end), "neigh", "del", self.address(far, end), "dev",
                        self.device(end, far))

    def is_cut(self, site: str, peer: str | None = None) -> bool:
        """Whether `site` sends into the blackhole on its link to `peer`."""
        ns, far = self.namespace(site), self.address(self._ends(site, peer)[1], site)
        entries = json.loads(_run(["ip", "-n", ns, "-j", "neigh", "show", "to", far]) or "[]")
        return any(e.get("lladdr") == BLACKHOLE_MAC for e in entries)

    def _cut_pairs(self, site: str | None, peer: str | None) -> list[tuple[str, str]]:
        if site is None:
            return list(self.pairs)
        return [self._ends(site, peer)]

    # --- inspection -----------------------------------------------------------------------
    def status(self) -> dict:
        """Per site: see mesh_status."""
        return mesh_status(self.prefix, self.sites)


def sites_up(name_prefix: str) -> tuple[str, ...]:
    """The sites of mesh `name_prefix` whose namespace `<prefix>-<site>` exists, in name order."""
    start = f"{name_prefix}-"
    return tuple(sorted(name[len(start):] for name in _existing_namespaces()
                        if name.startswith(start) and _SITE_RE.fullmatch(name[len(start):])))


def remove_mesh(name_prefix: str) -> list[str]:
    """Deletes every namespace of mesh `name_prefix`, also of a half-removed one; returns their names."""
    names = [f"{name_prefix}-{site}" for site in sites_up(name_prefix)]
    for name in names:
        _stop_delay_lines(name)
        _ip("netns", "delete", name)
    return names


# a bench's mesh: nb<kind><its pid>[x<serial>]-<site> (nebula_lab.bench.*, the WAN tests)
_BENCH_MESH = re.compile(r"nb[a-z]+(\d+)(?:x\d+)?-[a-z0-9]+")


def remove_orphans() -> list[str]:
    """Deletes what a bench killed with SIGKILL left behind (its `with WanLink` never exited): namespaces
    named after a bench process that is gone, in which nothing but our delay lines runs. Returns their names."""
    removed = []
    for name in _existing_namespaces():
        found = _BENCH_MESH.fullmatch(name)
        if not found or Path(f"/proc/{found[1]}").exists():
            continue
        try:
            lines = {pid for pid, _ in _delay_lines(name).values()}
            if any(int(pid) not in lines for pid in _run(["ip", "netns", "pids", name]).split()):
                continue  # something of someone's still runs in it: not ours to remove
            _stop_delay_lines(name)
            _ip("netns", "delete", name)
        except WanError:
            continue  # another bench starting at the same moment removed it first: best effort
        removed.append(name)
    return removed


def _delay_lines(ns: str) -> dict[str, tuple[int, float]]:
    """The delay-line processes running in namespace `ns`: TUN device -> (pid, one-way delay in s)."""
    found = {}
    for pid in _run(["ip", "netns", "pids", ns]).split():
        argv = cmdline(int(pid)) or []  # [] once gone meanwhile
        if DELAY_MODULE in argv and len(argv) >= argv.index(DELAY_MODULE) + 5:
            tun, _, _, delay_s = argv[argv.index(DELAY_MODULE) + 1: argv.index(DELAY_MODULE) + 5]
            found[tun] = (int(pid), float(delay_s))
    return found


def _stop_delay_lines(ns: str) -> None:
    for pid, _ in _delay_lines(ns).values():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    shutil.rmtree(_delay_run(ns), ignore_errors=True)


def _delay_run(ns: str) -> Path:
    """Where the delay lines of namespace `ns` write their logs while the mesh is up."""
    return Path(tempfile.gettempdir()) / f"nebula-wan-{ns}"


def mesh_status(name_prefix: str, sites: tuple[str, ...]) -> dict:
    """Per site: None when its namespace is absent, else its namespace, addresses ("ip/len" on all
    its links), "links" (per peer: None when absent, else the device, the site's address on it and
    its tbf qdisc) and "qdisc": the tbf settings and the counters summed over the site's links, None
    unless every link has its tbf. Two sites: "qdisc" is that of their one link."""
    present = set(_existing_namespaces())
    return {site: _site_status(f"{name_prefix}-{site}", [p for p in sites if p != site])
            if f"{name_prefix}-{site}" in present else None for site in sites}


def _site_status(ns: str, peers: list[str]) -> dict:
    addrs = json.loads(_run(["ip", "-n", ns, "-4", "-j", "addr", "show"]))
    qdiscs = json.loads(_run(["tc", "-n", ns, "-s", "-j", "qdisc", "show"]))
    devices = {i["ifname"]: [f"{a['local']}/{a['prefixlen']}" for a in i["addr_info"]] for i in addrs}
    tbfs = {q["dev"]: _tbf_status(q) for q in qdiscs if q.get("kind") == "tbf"}
    delays = _delay_lines(ns)
    links = {peer: None if DEVICE_PREFIX + peer not in devices else {
        "device": DEVICE_PREFIX + peer,
        "address": next((a.split("/")[0] for a in devices[DEVICE_PREFIX + peer]), None),
        "qdisc": tbfs.get(DEVICE_PREFIX + peer),
        # one-way delay added to what the site sends to the peer; None: none (or its delay line died)
        "delay_ms": round(delays[DELAY_PREFIX + peer][1] * 1000, 3) if DELAY_PREFIX + peer in delays else None,
        "delay_pid": delays[DELAY_PREFIX + peer][0] if DELAY_PREFIX + peer in delays else None,
    } for peer in peers}
    return {
        "namespace": ns,
        "addresses": [a for peer in peers for a in devices.get(DEVICE_PREFIX + peer, [])],
        "qdisc": _sum_qdiscs([link and link["qdisc"] for link in links.values()]),
        "links": links,
    }


def _tbf_status(tbf: dict) -> dict:
    return {
        "rate_mbit": tbf["options"]["rate"] * 8 / 1e6,
        "burst_bytes": tbf["options"]["burst"],
        "latency_us": tbf["options"]["lat"],
        **{k: tbf[k] for k in ("bytes", "packets", "drops", "overlimits", "backlog", "qlen")},
    }


def _sum_qdiscs(qdiscs: list[dict | None]) -> dict | None:
    """Settings of the first (every link has the same), counters summed; None if a link has none."""
    if not qdiscs or None in qdiscs:
        return None
    counters = ("bytes", "packets", "drops", "overlimits", "backlog", "qlen")
    return {**qdiscs[0], **{k: sum(q[k] for q in qdiscs) for k in counters}}


def _is_complete(info: dict | None) -> bool:
    return bool(info and info["qdisc"] and all(link["address"] for link in info["links"].values()))


def _layout(status: dict) -> tuple[tuple[str, ...], str]:
    """The site order and a subnet that give a complete mesh's addresses, read back from them.

    Links take consecutive /30s in the order of combinations(sites, 2), the pair's first site on
    host 1: the lowest /30 holds sites[0] and sites[1], and sites[0]'s links, lowest first, lead to
    the others in order. The subnet is the lowest /30 widened until it holds the highest.
    """
    ends: dict[ipaddress.IPv4Network, dict[int, str]] = {}  # link /30 -> host number -> site
    for site, info in status.items():
        for link in info["links"].values():
            iface = ipaddress.IPv4Interface(f"{link['address']}/{LINK_PREFIXLEN}")
            ends.setdefault(iface.network, {})[int(iface.ip) - int(iface.network.network_address)] = site
    nets = sorted(ends)
    first = ends[nets[0]].get(1)
    order = (first, *(ends[net].get(2) for net in nets if ends[net].get(1) == first))
    subnet = nets[0]
    while not nets[-1].subnet_of(subnet):
        subnet = subnet.supernet()
    return order, str(subnet)


# --- host checks and command helpers ------------------------------------------------------
def shape(ns: str, dev: str, rate_mbit: float) -> None:
    """Limit what `dev` in namespace `ns` sends to `rate_mbit`: the tbf and the small-packet priority inside
    it that every link of a WanLink has (the module docstring says why each parameter is what it is)."""
    _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{rate_mbit}mbit",
          "burst", str(tbf_burst_bytes(rate_mbit)), "limit", str(tbf_limit_bytes(rate_mbit))])
    _prioritise_small_packets(ns, dev, tbf_limit_bytes(rate_mbit))


def _prioritise_small_packets(ns: str, dev: str, limit_bytes: int) -> None:
    """Inside tbf, serve small TCP packets (pure ACKs, SYNs) before bulk data.

    When both directions are saturated (forward activations one way, gradients the other), each
    connection's ACKs share a queue with the other connection's data. A FIFO then delays ACKs by the
    whole queue (seconds at sub-Mbit/s rates), which collapses TCP throughput far below the link
    rate; a router with per-flow or small-packet priority does not. HTB here only orders the two
    classes (its rates are far above the link's); tbf still sets the pace.
    """
    tc = ["tc", "-n", ns]
    _run([*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "htb", "default", "20"])
    _run([*tc, "class", "add", "dev", dev, "parent", "10:", "classid", "10:1", "htb",
          "rate", "10gbit", "quantum", "15140"])
    for classid, prio in zip(SMALL_PACKET_CLASSES, ("0", "1")):
        _run([*tc, "class", "add", "dev", dev, "parent", "10:1", "classid", classid, "htb",
              "rate", "5gbit", "ceil", "10gbit", "prio", prio, "quantum", "15140"])
        _run([*tc, "qdisc", "add", "dev", dev, "parent", classid, "bfifo", "limit", str(limit_bytes)])
    # IPv4 TCP with total length < 128 bytes: ACK-only and control packets
    _run([*tc, "filter", "add", "dev", dev, "parent", "10:", "protocol", "ip", "prio", "1", "u32",
          "match", "ip", "protocol", "6", "0xff", "match", "u16", "0x0000", "0xff80", "at", "2",
          "flowid", "10:10"])


def check_host() -> None:
    """Raises WanError unless this process can create namespaces and shape links."""
    if os.geteuid() != 0:
        raise WanError("needs root: network namespaces and tc need CAP_NET_ADMIN "
                       "(run with sudo, or as root in a container started with --privileged)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            raise WanError(f"`{tool}` is missing: install the {package} package "
                           f"(apt-get install {package})")


def _existing_namespaces() -> list[str]:
    # `ip netns list` prints "name (id: N)" per line; the name is the first word.
    out = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30)
    except FileNotFoundError as exc:
        raise WanError(f"`{argv[0]}` is missing: install iproute2") from exc
    except subprocess.CalledProcessError as exc:
        raise WanError(f"`{' '.join(argv)}` failed: {exc.stderr.strip() or exc.returncode}") from exc
    except subprocess.TimeoutExpired as exc:
        raise WanError(f"`{' '.join(argv)}` hung for 30 s; check the host's network stack") from exc
    return done.stdout


def _check_sites(sites: tuple[str, ...]) -> tuple[str, ...]:
    sites = tuple(sites)
    for site in sites:
        if not (isinstance(site, str) and _SITE_RE.fullmatch(site)):
            raise ConfigError(f"WAN site name {site!r} is invalid: use 1-11 lowercase letters or digits "
                              f"(its device `{DEVICE_PREFIX}<site>` must fit Linux's 15-character names)")
    if len(sites) < 2:
        raise ConfigError(f"a WAN needs at least two sites, got {', '.join(sites) or 'none'}")
    if twice := sorted({site for site in sites if sites.count(site) > 1}):
        raise ConfigError(f"WAN site(s) {', '.join(twice)} given more than once: name each site once")
    return sites


def _link_addresses(pairs: tuple[tuple[str, str], ...], subnet: str) -> dict[tuple[str, str], str]:
    """(site, peer) -> the site's address on their link: pair i takes the i-th /30 of `subnet`."""
    try:
        net = ipaddress.IPv4Network(subnet, strict=True)
    except ValueError as exc:
        raise ConfigError(f"WAN subnet {subnet!r} is invalid: give an IPv4 network such as "
                          f"{DEFAULT_SUBNET}") from exc
    needed = LINK_PREFIXLEN - (len(pairs) - 1).bit_length()  # a /needed holds len(pairs) /30s
    if not net.is_private or net.prefixlen > needed:
        raise ConfigError(f"WAN subnet {subnet} must be private and hold one /30 (two hosts) per pair "
                          f"of sites, {len(pairs)} here (a /{needed} or larger), so it can exist only "
                          "inside the emulation's namespaces")
    addresses = {}
    for (site, peer), link in zip(pairs, net.subnets(new_prefix=LINK_PREFIXLEN)):
        addresses[site, peer] = str(link.network_address + 1)
        addresses[peer, site] = str(link.network_address + 2)
    return addresses


# --- goodput measurement ------------------------------------------------------------------
CHUNK = 1 << 20


def measure_goodput(link: WanLink, nbytes: int, src: str = "a", dst: str = "b",
                    timeout_s: float | None = None) -> float:
    """Sends `nbytes` over one plain TCP connection from site `src` to site `dst` (over their link);
    returns Mbit/s.

    Both ends are separate processes inside their namespaces (`python -m nebula_lab.wanem recv|send`).
    The receiver times from accepting the connection to end of stream, so the figure includes slow
    start and is the payload rate a transfer of this size actually gets.
    """
    if nbytes <= 0:
        raise ConfigError(f"goodput transfer size must be positive, got {nbytes}")
    if timeout_s is None:  # ten times the wire time, plus process start-up
        timeout_s = 10 * nbytes * 8 / (link.rate_mbit * 1e6) + 10
    host = link.address(dst, peer=src)  # dst's end of the src-dst link
    recv = ServiceSpec(name="goodput-recv", ready="ready ", argv=(
        *link.exec_prefix(dst), sys.executable, "-m", "nebula_lab.wanem", "recv", host, str(timeout_s)),
                       run=Path(tempfile.mkdtemp(prefix="nebula-goodput-")))
    try:
        with Supervisor() as receivers:
            receiver = receivers.ready(receivers.start(recv).name, timeout=30)
            port = int(receiver.log.read_text().split("ready ", 1)[1].split()[0])
            link.run(src, [sys.executable, "-m", "nebula_lab.wanem", "send", host, str(port),
                           str(nbytes)], check=True, timeout=timeout_s, capture_output=True)
            receivers.run(receiver.finished, timeout=timeout_s, what="the goodput receiver")
            result = json.loads(receiver.log.read_text().strip().splitlines()[-1])
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, StageError) as exc:
        detail = getattr(exc, "stderr", None) or ""
        raise WanError(f"goodput transfer {src} -> {dst} failed: {exc} {detail}".strip()) from exc
    finally:
        shutil.rmtree(recv.run, ignore_errors=True)
    if result["bytes"] != nbytes:
        raise WanError(f"goodput receiver got {result['bytes']} of {nbytes} bytes")
    return result["bytes"] * 8 / result["seconds"] / 1e6


def measure_rtt(link: WanLink, src: str = "a", dst: str = "b", count: int = 5) -> list[float]:
    """Round trips from `src` to `dst` over their link, in ms: each the time a TCP connect to port 9
    (discard, closed) of dst's end takes to be refused, i.e. SYN out, RST back. Measure on an idle link:
    under a transfer the tbf queue adds its delay."""
    out = link.run(src, [sys.executable, "-m", "nebula_lab.wanem", "rtt", link.address(dst, peer=src), str(count)],
                   capture_output=True, text=True, timeout=30 + count * (link.rtt_ms / 1000 + 3))
    if out.returncode != 0:
        raise WanError(f"round-trip measurement {src} -> {dst} failed: {out.stderr.strip()}")
    return json.loads(out.stdout)


def _round_trips(host: str, count: int) -> None:
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        try:
            socket.create_connection((host, 9), timeout=10).close()
        except ConnectionRefusedError:
            samples.append((time.perf_counter() - start) * 1000)
        else:
            sys.exit(f"port 9 of {host} accepted a connection: cannot time a refusal")
    print(json.dumps([round(ms, 3) for ms in samples]), flush=True)


def _receive(host: str, timeout_s: float) -> None:
    with socket.create_server((host, 0)) as server:
        server.settimeout(timeout_s)  # never outlive a sender that failed to start
        print(f"ready {server.getsockname()[1]}", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout_s)
            start, total, buf = time.perf_counter(), 0, bytearray(CHUNK)
            while n := conn.recv_into(buf):
                total += n
            seconds = time.perf_counter() - start
    print(json.dumps({"bytes": total, "seconds": seconds}), flush=True)


def _send(host: str, port: int, nbytes: int) -> None:
    chunk = memoryview(bytes(CHUNK))
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.settimeout(None)
        for start in range(0, nbytes, CHUNK):
            conn.sendall(chunk[: min(CHUNK, nbytes - start)])
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # returns when the receiver has read everything and closed


if __name__ == "__main__":
    # The two ends of measure_goodput, run inside the site namespaces.
    if sys.argv[1:2] == ["recv"]:
        _receive(sys.argv[2], float(sys.argv[3]))
    elif sys.argv[1:2] == ["send"]:
        _send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1:2] == ["rtt"]:
        _round_trips(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit("usage: python -m nebula_lab.wanem recv HOST TIMEOUT_S | send HOST PORT NBYTES | rtt HOST COUNT")
