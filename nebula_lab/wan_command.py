"""`nebula wan up|down|status|rate|measure`: the WAN emulation, a full mesh of site namespaces (see
nebula_lab/wanem.py, docs/wan.md)."""
from __future__ import annotations

import argparse
import json
import statistics

from nebula_lab.wanem import (  # wanem imports only the standard library
    DEFAULT_SITES,
    DEFAULT_SUBNET,
    WanLink,
    check_host,
    measure_goodput,
    measure_rtt,
    mesh_status,
    remove_mesh,
    sites_up,
)

DEFAULT_PREFIX = "nebula"


def register(sub) -> None:
    parser = sub.add_parser("wan", help="emulate a WAN: site namespaces joined pairwise by shaped links")
    wan_sub = parser.add_subparsers(dest="wan", required=True, metavar="ACTION")

    up = _action(wan_sub, "up", "create namespace <prefix>-<site> per site and a shaped link per pair", _up)
    sites = ",".join(DEFAULT_SITES)
    up.add_argument("--sites", default=sites,
                    help=f"comma-separated site names, lowercase letters and digits (default {sites})")
    up.add_argument("--rate-mbit", type=float, default=60.0, help="rate of each link, each way (default 60)")
    up.add_argument("--rtt-ms", type=float, default=0.0,
                    help="round-trip propagation delay to add on each link, half each way, by a user-space "
                         "delay line (default 0: none)")
    up.add_argument("--subnet", default=DEFAULT_SUBNET,
                    help=f"private IPv4 subnet, one /30 per pair of sites (default {DEFAULT_SUBNET})")

    _action(wan_sub, "down", "remove the namespaces (and with them the links)", _down)
    status = _action(wan_sub, "status", "show namespaces, addresses and qdisc counters", _status)
    status.add_argument("--json", action="store_true", help="print JSON instead of text")

    rate = _action(wan_sub, "rate", "change the rate of every link now, with jobs running over it", _rate)
    rate.add_argument("rate_mbit", type=float, metavar="MBIT", help="the new rate of each link, each way, in Mbit/s")

    measure = _action(wan_sub, "measure", "measure TCP goodput from one site to another", _measure)
    measure.add_argument("--mbytes", type=float, default=20.0, help="transfer size in MB (default 20)")
    measure.add_argument("--src", default="a", help="sending site (default a)")
    measure.add_argument("--dst", default="b", help="receiving site (default b)")


def _action(wan_sub, name: str, help_text: str, handler) -> argparse.ArgumentParser:
    parser = wan_sub.add_parser(name, help=help_text)
    parser.add_argument("--prefix", default=DEFAULT_PREFIX,
                        help=f"namespace name prefix (default {DEFAULT_PREFIX})")
    parser.set_defaults(func=handler)
    return parser


def _up(args) -> int:
    sites = tuple(site.strip() for site in args.sites.split(","))
    link = WanLink(name_prefix=args.prefix, rate_mbit=args.rate_mbit, subnet=args.subnet, sites=sites,
                   rtt_ms=args.rtt_ms).up()
    for site in link.sites:
        ends = ", ".join(f"{link.address(site, peer)} on {link.device(site, peer)} (to {peer})"
                         for peer in link.peers(site))
        print(f"site {site}: namespace {link.namespace(site)}, address {ends}, "
              f"run inside with: {' '.join(link.exec_prefix(site))} CMD")
    print(f"links: {len(link.pairs)}, {link.rate_mbit:g} Mbit/s each way, {link.rtt_ms:g} ms added RTT; "
          f"remove with: nebula wan down --prefix {args.prefix}")
    return 0


def _down(args) -> int:
    check_host()
    removed = remove_mesh(args.prefix)
    print(f"removed {', '.join(removed)}" if removed else f"nothing to remove for prefix {args.prefix}")
    return 0


def _status(args) -> int:
    check_host()
    found = sites_up(args.prefix)
    # Fewer than two namespaces left: report the default sites too, so that what is missing shows.
    status = mesh_status(args.prefix, found if len(found) >= 2 else tuple(dict.fromkeys(found + DEFAULT_SITES)))
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        for site, info in status.items():
            print(_format_site(site, info, args.prefix))
    return 0 if all(info and info["qdisc"] for info in status.values()) else 1


def _format_site(site: str, info: dict | None, prefix: str) -> str:
    if info is None:
        return f"site {site}: namespace {prefix}-{site} is not up (run: nebula wan up --prefix {prefix})"
    line = f"site {site}: {info['namespace']} {' '.join(info['addresses'])}  {_format_qdisc(info['qdisc'])}"
    if len(info["links"]) == 1:  # the site line is its one link
        return line
    return "\n".join([line, *(f"  to {peer}: {_format_link(link)}" for peer, link in info["links"].items())])


def _format_link(link: dict | None) -> str:
    return "no link" if link is None else f"{link['device']} {link['address']}  {_format_qdisc(link['qdisc'])}"


def _format_qdisc(q: dict | None) -> str:
    if q is None:
        return "no tbf qdisc"
    return (f"tbf {q['rate_mbit']:g} Mbit/s burst {q['burst_bytes']} B queue {q['latency_us'] / 1000:.0f} ms; "
            f"sent {q['bytes']} B / {q['packets']} pkts, dropped {q['drops']}, backlog {q['backlog']} B")


def _rate(args) -> int:
    link = WanLink.attach(args.prefix)
    before = link.rate_mbit
    link.set_rate(args.rate_mbit)
    print(f"links of {args.prefix}: {before:g} -> {link.rate_mbit:g} Mbit/s each way (connections kept)")
    return 0


def _measure(args) -> int:
    link = WanLink.attach(args.prefix)
    rtts = measure_rtt(link, src=args.src, dst=args.dst)  # first, on the idle link
    print(f"round trip {args.src} -> {args.dst}: median {statistics.median(rtts):.1f} ms "
          f"(min {min(rtts):.1f}, max {max(rtts):.1f}, {len(rtts)} TCP connects; {link.rtt_ms:g} ms added)")
    mbit = measure_goodput(link, int(args.mbytes * 1e6), src=args.src, dst=args.dst)
    print(f"goodput {args.src} -> {args.dst}: {mbit:.2f} Mbit/s = {mbit / link.rate_mbit:.1%} "
          f"of the {link.rate_mbit:g} Mbit/s link")
    return 0
