"""`nebula wan up|down|status|measure`: the two-namespace WAN emulation (see nebula/wanem.py, docs/wan.md)."""
from __future__ import annotations

import argparse
import json

DEFAULT_PREFIX = "nebula"


def register(sub) -> None:
    parser = sub.add_parser("wan", help="emulate a WAN: two site namespaces joined by a shaped link")
    wan_sub = parser.add_subparsers(dest="wan", required=True, metavar="ACTION")

    up = _action(wan_sub, "up", "create namespaces <prefix>-a and <prefix>-b and the shaped link", _up)
    up.add_argument("--rate-mbit", type=float, default=60.0, help="link rate each way (default 60)")
    up.add_argument("--subnet", default="10.213.0.0/30",
                    help="private IPv4 subnet for the two ends (default 10.213.0.0/30)")

    _action(wan_sub, "down", "remove the namespaces (and with them the link)", _down)
    status = _action(wan_sub, "status", "show namespaces, addresses and qdisc counters", _status)
    status.add_argument("--json", action="store_true", help="print JSON instead of text")

    measure = _action(wan_sub, "measure", "measure TCP goodput from site a to site b", _measure)
    measure.add_argument("--mbytes", type=float, default=20.0, help="transfer size in MB (default 20)")


def _action(wan_sub, name: str, help_text: str, handler) -> argparse.ArgumentParser:
    parser = wan_sub.add_parser(name, help=help_text)
    parser.add_argument("--prefix", default=DEFAULT_PREFIX,
                        help=f"namespace name prefix (default {DEFAULT_PREFIX})")
    parser.set_defaults(func=handler)
    return parser


def _up(args) -> int:
    from nebula.wanem import WanLink

    link = WanLink(name_prefix=args.prefix, rate_mbit=args.rate_mbit, subnet=args.subnet).up()
    for site in ("a", "b"):
        print(f"site {site}: namespace {link.namespace(site)}, address {link.address(site)}, "
              f"run inside with: {' '.join(link.exec_prefix(site))} CMD")
    print(f"link: {link.rate_mbit:g} Mbit/s each way; remove with: nebula wan down --prefix {args.prefix}")
    return 0


def _down(args) -> int:
    from nebula.wanem import WanLink, check_host

    check_host()
    link = WanLink(name_prefix=args.prefix)
    removed = link.exists()
    link.down()
    print(f"removed {', '.join(removed)}" if removed else f"nothing to remove for prefix {args.prefix}")
    return 0


def _status(args) -> int:
    from nebula.wanem import WanLink, check_host

    check_host()
    status = WanLink(name_prefix=args.prefix).status()
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        for site, info in status.items():
            print(_format_site(site, info, args.prefix))
    return 0 if all(status.values()) else 1


def _format_site(site: str, info: dict | None, prefix: str) -> str:
    if info is None:
        return f"site {site}: namespace {prefix}-{site} is not up (run: nebula wan up --prefix {prefix})"
    q = info["qdisc"]
    shaping = "no tbf qdisc" if q is None else (
        f"tbf {q['rate_mbit']:g} Mbit/s burst {q['burst_bytes']} B queue {q['latency_us'] / 1000:.0f} ms; "
        f"sent {q['bytes']} B / {q['packets']} pkts, dropped {q['drops']}, backlog {q['backlog']} B")
    return f"site {site}: {info['namespace']} {' '.join(info['addresses'])}  {shaping}"


def _measure(args) -> int:
    from nebula.wanem import WanLink, measure_goodput

    link = WanLink.attach(args.prefix)
    mbit = measure_goodput(link, int(args.mbytes * 1e6))
    print(f"goodput a -> b: {mbit:.2f} Mbit/s = {mbit / link.rate_mbit:.1%} "
          f"of the {link.rate_mbit:g} Mbit/s link")
    return 0
