"""WAN emulation: real namespaces, real tbf-shaped veth pairs (one per pair of sites), real TCP
between two processes.

Each test uses its own namespace prefix (pid + test number) so parallel runs and a running demo
(`nebula wan up`, prefix "nebula") never collide.
"""
from __future__ import annotations

import functools
import itertools
import os
import shutil
import subprocess
import sys
import time

import pytest

from nebula.errors import ConfigError
from nebula.site.process import alive
from nebula_lab.wanem import (
    WanError,
    WanLink,
    check_host,
    measure_goodput,
    measure_rtt,
    tbf_burst_bytes,
    tbf_limit_bytes,
)

_serial = itertools.count()


def unique_prefix() -> str:
    return f"nbt{os.getpid()}x{next(_serial)}"


def host_namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


# Connects to port 9 of each address: "ConnectionRefusedError" means the other end's kernel answered.
_PROBE = """import socket, sys
for address in sys.argv[1:]:
    try:
        socket.create_connection((address, 9), timeout=2).close()
        print("open")
    except OSError as exc:
        print(type(exc).__name__)
"""


def wan_cli(prefix: str, *args: str) -> subprocess.CompletedProcess:
    """`nebula wan ARGS --prefix PREFIX`, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "nebula.cli", "wan", *args, "--prefix", prefix],
                          capture_output=True, text=True, timeout=50)


def reached_from(link: WanLink, site: str, addresses: list[str]) -> list[bool]:
    out = link.run(site, [sys.executable, "-c", _PROBE, *addresses], capture_output=True, text=True,
                   check=True, timeout=30).stdout.split()
    return [answer == "ConnectionRefusedError" for answer in out]


@pytest.fixture
def needs_root():
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs `ip` and `tc` (iproute2) for network namespaces and shaping")


# --- no root needed ---------------------------------------------------------------------------
def test_names_addresses_and_exec_prefix():
    link = WanLink(name_prefix="demo1", rate_mbit=10, subnet="10.99.0.0/24")
    assert link.namespace("b") == "demo1-b"
    assert (link.address("a"), link.address("b")) == ("10.99.0.1", "10.99.0.2")
    assert link.exec_prefix("a") == ["ip", "netns", "exec", "demo1-a"]


@pytest.mark.parametrize("kwargs, fragment", [
    ({"name_prefix": "Bad Name"}, "prefix"),
    ({"rate_mbit": 0}, "rate"),
    ({"subnet": "8.8.8.0/30"}, "private"),
    ({"subnet": "10.0.0.0/31"}, "two hosts"),
    ({"subnet": "not-a-net"}, "IPv4 network"),
])
def test_bad_arguments_are_config_errors(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        WanLink(**kwargs)


def test_unknown_site_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown WAN site 'c'"):
        WanLink().address("c")


def test_three_sites_one_link_per_pair_each_in_its_own_slash_30():
    link = WanLink(name_prefix="demo3", sites=("a", "b", "c"))
    assert link.pairs == (("a", "b"), ("a", "c"), ("b", "c"))
    assert [(link.address(x, y), link.address(y, x)) for x, y in link.pairs] == [
        ("10.213.0.1", "10.213.0.2"), ("10.213.0.5", "10.213.0.6"), ("10.213.0.9", "10.213.0.10")]
    assert (link.device("a", "c"), link.device("c", "a"), link.namespace("c")) == ("wan-c", "wan-a", "demo3-c")
    assert WanLink().address("a") == WanLink().address("a", peer="b") == "10.213.0.1"  # two sites: peer implied
    with pytest.raises(ConfigError, match="name the peer"):
        link.address("a")
    with pytest.raises(ConfigError, match="no link to itself"):
        link.address("a", peer="a")


@pytest.mark.parametrize("kwargs, fragment", [
    ({"sites": ("a",)}, "at least two sites"),
    ({"sites": ("a", "b", "a")}, "given more than once"),
    ({"sites": ("a", "B")}, "lowercase letters or digits"),
    ({"sites": ("a", "gpu-east")}, "lowercase letters or digits"),
    ({"sites": ("a", "abcdefghijkl")}, "15-character"),  # wan-abcdefghijkl: 16 characters
    ({"sites": ("a", "b", "c"), "subnet": "10.0.0.0/29"}, r"3 here \(a /28 or larger\)"),
])
def test_bad_sites_are_config_errors(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        WanLink(**kwargs)


def test_not_root_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(WanError, match="needs root: network namespaces"):
        check_host()


def test_tbf_sizes_follow_the_rate():
    # A tick (4 ms) of tokens at high rates, 10 frames at low ones; a queue of >= 256 KiB.
    assert tbf_burst_bytes(170) == 85_000 and tbf_burst_bytes(10) == 15_140
    assert tbf_limit_bytes(10) == 15_140 + 256 * 1024
    assert tbf_limit_bytes(170) == 85_000 + 1_062_500


# --- root: real namespaces ----------------------------------------------------------------------
@pytest.mark.root
@pytest.mark.timeout(60)
def test_goodput_at_20_mbit_is_near_the_rate(needs_root):
    prefix = unique_prefix()
    with WanLink(name_prefix=prefix, rate_mbit=20) as link:
        assert {link.namespace("a"), link.namespace("b")} <= host_namespaces()
        mbit = measure_goodput(link, 4_000_000)  # ~1.7 s on the wire
        status = link.status()
    assert 0.85 * 20 <= mbit <= 1.05 * 20, f"goodput {mbit:.2f} Mbit/s on a 20 Mbit/s link"
    assert status["a"]["qdisc"]["rate_mbit"] == 20 and status["b"]["qdisc"]["rate_mbit"] == 20
    assert status["a"]["qdisc"]["bytes"] >= 4_000_000  # the data did go through the shaper
    assert not ({f"{prefix}-a", f"{prefix}-b"} & host_namespaces())


@pytest.mark.root
@pytest.mark.timeout(60)
def test_both_directions_saturated_each_keep_the_rate(needs_root):
    """Activations one way and gradients the other: ACKs must not wait behind the other direction's
    data (a FIFO queue held one direction to ~0.6 of the rate at 0.5 Mbit/s)."""
    import threading
    rate, results = 2.0, {}
    with WanLink(name_prefix=unique_prefix(), rate_mbit=rate) as link:
        def run(src: str, dst: str) -> None:
            results[src] = measure_goodput(link, 600_000, src=src, dst=dst)  # ~2.5 s on the wire
        threads = [threading.Thread(target=run, args=pair) for pair in (("a", "b"), ("b", "a"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(45)
    assert min(results.values()) >= 0.85 * rate, f"goodput both ways: {results} on a {rate} Mbit/s link"


@pytest.mark.root
@pytest.mark.timeout(90)
def test_the_rate_changes_under_a_running_transfer_and_on_every_link(needs_root):
    """`set_rate` mid-transfer (a WAN whose capacity changes under a job): one TCP connection carries on
    at the new rate, on every link of a three-site mesh; `nebula wan rate` does the same from a shell."""
    import threading
    with WanLink(name_prefix=unique_prefix(), rate_mbit=20, sites=("a", "b", "c")) as link:
        result = {}
        transfer = threading.Thread(target=lambda: result.update(mbit=measure_goodput(link, 1_200_000)))
        transfer.start()  # 0.5 s at 20 Mbit/s: cut to 2 Mbit/s after 0.3 s, it takes ~2-3 s more
        time.sleep(0.3)
        link.set_rate(2)
        transfer.join(60)
        assert result["mbit"] < 0.5 * 20, result  # it did not finish at the old rate
        assert all(end["qdisc"]["rate_mbit"] == 2 for site in link.status().values() for end in site["links"].values())
        assert 0.85 * 2 <= measure_goodput(link, 300_000, src="c", dst="b") <= 1.1 * 2
        changed = wan_cli(link.prefix, "rate", "5")
        assert changed.returncode == 0 and "2 -> 5 Mbit/s" in changed.stdout, changed.stderr
        assert WanLink.attach(link.prefix).rate_mbit == 5
        assert 0.85 * 5 <= measure_goodput(link, 600_000) <= 1.1 * 5
        with pytest.raises(ConfigError, match="out of range"):
            link.set_rate(0)


@pytest.mark.root
def test_addresses_exist_only_inside_the_namespaces(needs_root):
    with WanLink(name_prefix=unique_prefix(), rate_mbit=50) as link:
        host = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, check=True).stdout
        inside = link.run("a", ["ip", "-4", "addr"], capture_output=True, text=True, check=True).stdout
        assert link.address("a") not in host
        assert link.address("a") in inside and "127.0.0.1" in inside  # loopback is up too


@pytest.mark.root
@pytest.mark.timeout(60)
def test_three_sites_each_pair_reaches_only_over_its_link_near_the_rate(needs_root):
    with WanLink(name_prefix=unique_prefix(), rate_mbit=20, sites=("a", "b", "c")) as link:
        ends = {(x, y): link.address(x, y) for x in link.sites for y in link.peers(x)}  # x's end of x-y
        for site in link.sites:  # a site reaches its peers' ends of its own links, and no other address
            probed = [(x, y) for x, y in ends if x != site]
            assert reached_from(link, site, [ends[x, y] for x, y in probed]) == [y == site for x, y in probed]
        mbit = measure_goodput(link, 2_500_000, src="a", dst="c")  # ~1 s on the wire
        status = link.status()
    assert 0.85 * 20 <= mbit <= 1.05 * 20, f"goodput a -> c {mbit:.2f} Mbit/s on a 20 Mbit/s link"
    a = status["a"]
    assert a["links"]["c"]["device"] == "wan-c" and a["links"]["c"]["address"] == ends["a", "c"]
    assert a["links"]["c"]["qdisc"]["bytes"] >= 2_500_000 > 100 * a["links"]["b"]["qdisc"]["bytes"]
    assert a["qdisc"]["bytes"] == a["links"]["b"]["qdisc"]["bytes"] + a["links"]["c"]["qdisc"]["bytes"]


@pytest.mark.root
def test_attach_reads_back_the_sites_in_their_order_rate_and_addresses(needs_root):
    prefix = unique_prefix()
    with WanLink(name_prefix=prefix, rate_mbit=7.5, subnet="10.213.4.0/26", sites=("c", "a", "b")) as link:
        attached = WanLink.attach(prefix)
    assert (attached.sites, attached.rate_mbit, attached.subnet) == (("c", "a", "b"), 7.5, "10.213.4.0/28")
    assert all(attached.address(x, y) == link.address(x, y) for x in link.sites for y in link.peers(x))
    with pytest.raises(WanError, match=f"is not up: run `nebula wan up --prefix {prefix}`"):
        WanLink.attach(prefix)


@pytest.mark.root
@pytest.mark.parametrize("sites", [("a", "b"), ("a", "b", "c")])
def test_namespaces_removed_when_the_body_raises(needs_root, sites):
    prefix = unique_prefix()
    with pytest.raises(RuntimeError, match="boom"):
        with WanLink(name_prefix=prefix, rate_mbit=10, sites=sites):
            assert f"{prefix}-{sites[-1]}" in host_namespaces()
            raise RuntimeError("boom")
    assert not ({f"{prefix}-{site}" for site in sites} & host_namespaces())


@pytest.mark.root
def test_up_refuses_existing_namespaces_and_leaves_them(needs_root):
    prefix = unique_prefix()
    with WanLink(name_prefix=prefix, rate_mbit=10) as first:
        with pytest.raises(WanError, match=f"already exist: run `nebula wan down --prefix {prefix}`"):
            WanLink(name_prefix=prefix, rate_mbit=30).up()
        with pytest.raises(WanError, match="already exist"):  # the prefix names one mesh
            WanLink(name_prefix=prefix, sites=("c", "d")).up()
        assert first.status()["b"]["qdisc"]["rate_mbit"] == 10  # the first link is untouched


@pytest.mark.root
def test_up_removes_the_meshes_of_killed_benches_and_nothing_else(needs_root):
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has now: the bench that named the mesh was SIGKILLed
    orphan, live, busy = f"nbt{gone.pid}x0-a", f"{unique_prefix()}-a", f"nbt{gone.pid}x1-a"
    for name in (orphan, live, busy):
        subprocess.run(["ip", "netns", "add", name], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", busy, "sleep", "60"])
    try:
        time.sleep(0.2)
        with WanLink(name_prefix=unique_prefix(), rate_mbit=10):
            left = host_namespaces()
        assert orphan not in left  # its bench is gone and nothing runs in it
        assert live in left and busy in left  # a live bench's mesh, and one something still runs in
    finally:
        sleeper.kill()
        sleeper.wait()
        for name in (orphan, live, busy):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@pytest.mark.root
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sites, shown, route, direction", [
    ("a,b", "10.213.0.2/30  tbf 40 Mbit/s", (), "a -> b"),
    ("a,b,c", "  to c: wan-c 10.213.0.5  tbf 40 Mbit/s", ("--src", "c", "--dst", "a"), "c -> a"),
])
def test_cli_up_status_measure_down(needs_root, sites, shown, route, direction):
    prefix = unique_prefix()
    nebula = functools.partial(wan_cli, prefix)

    try:
        site_args = () if sites == "a,b" else ("--sites", sites)  # a,b is the default
        assert nebula("up", *site_args, "--rate-mbit", "40").returncode == 0
        again = nebula("up")
        assert again.returncode == 2 and "nebula wan down" in again.stderr
        status = nebula("status")
        assert status.returncode == 0 and shown in status.stdout, status.stdout
        measured = nebula("measure", "--mbytes", "3", *route)
        assert measured.returncode == 0 and "of the 40 Mbit/s link" in measured.stdout, measured.stderr
        assert f"goodput {direction}:" in measured.stdout
    finally:
        down = nebula("down")
    removed = ", ".join(f"{prefix}-{site}" for site in sites.split(","))
    assert down.returncode == 0 and f"removed {removed}" in down.stdout
    assert nebula("status").returncode == 1


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_delay_line_adds_the_round_trip_and_keeps_the_cut(needs_root):
    """rtt_ms = 80 on a 20 Mbit/s link: a TCP connect's refusal comes back after 80 ms (+ a few ms of
    scheduling), attach reads the delay back, a cut still silences the link, and down() leaves no
    delay-line process and no namespace behind."""
    with WanLink(name_prefix=unique_prefix(), rate_mbit=20, rtt_ms=80) as link:
        rtts = measure_rtt(link, "a", "b")
        assert all(80 <= ms < 100 for ms in rtts), rtts
        assert WanLink.attach(link.prefix).rtt_ms == 80
        pids = [end["delay_pid"] for site in link.sites for end in link.status()[site]["links"].values()]
        assert all(pids) and len(set(pids)) == 2
        link.cut()
        assert reached_from(link, "a", [link.address("b")]) == [False]
        link.restore()
        assert reached_from(link, "a", [link.address("b")]) == [True]
    assert not any(alive(pid) for pid in pids)
    assert not {f"{link.prefix}-a", f"{link.prefix}-b"} & host_namespaces()
