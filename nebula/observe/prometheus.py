"""Prometheus metrics of a service, served by prometheus_client; off unless NEBULA_METRICS_PORT is set.

The exporter holds no counters of its own: each scrape turns the record the service last wrote to
its status file (nebula.observe.status) into metric families, so `nebula site status`, `nebula
health` and Prometheus always show the same numbers. Names and labels: docs/runtime.md.
"""
from __future__ import annotations

import errno
import os
from typing import Any, Callable, Iterator, Mapping
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, StateSetMetricFamily

from nebula.errors import ConfigError
from nebula.observe.status import STATES

PORT_ENV, BIND_ENV = "NEBULA_METRICS_PORT", "NEBULA_METRICS_BIND"
DEFAULT_BIND = "127.0.0.1"  # local only: a site publishes metrics on purpose, never by default


def metrics_endpoint(environ: Mapping[str, str] = os.environ) -> tuple[str, int] | None:
    """(bind, port) from NEBULA_METRICS_BIND / NEBULA_METRICS_PORT; None when the port is unset or 0."""
    text = environ.get(PORT_ENV, "").strip()
    if not text:
        return None
    try:
        port = int(text)
    except ValueError:
        raise ConfigError(f"{PORT_ENV}={text!r}: expected a TCP port number (1-65535), or 0 / unset for "
                          "no metrics") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{PORT_ENV}={port}: a TCP port is 1-65535 (0 or unset: no metrics)")
    return (environ.get(BIND_ENV, "").strip() or DEFAULT_BIND, port) if port else None


class Exporter:
    """An HTTP /metrics endpoint whose every scrape reads `current()`: the service's last status record."""

    def __init__(self, bind: str, port: int, current: Callable[[], dict[str, Any]]) -> None:
        self.bind, self.port, self.current = bind, port, current
        self._server: WSGIServer | None = None

    def start(self) -> Exporter:
        registry = CollectorRegistry()
        registry.register(_Collector(self.current))
        ProcessCollector(registry=registry)  # process_cpu_seconds_total, resident memory, open fds
        try:
            self._server, _ = start_http_server(self.port, addr=self.bind, registry=registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"metrics port {self.port} on {self.bind} is already in use ({PORT_ENV}="
                                  f"{self.port}): stop what holds it, or give this service another port "
                                  "([metrics] port in the site config)") from None
            raise ConfigError(f"cannot serve metrics on {self.bind}:{self.port} ({BIND_ENV}, {PORT_ENV}): "
                              f"{exc.strerror or exc}") from exc
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Collector:
    def __init__(self, current: Callable[[], dict[str, Any]]) -> None:
        self.current = current

    def collect(self) -> Iterator[Any]:
        record = self.current()
        if record:
            yield from service_families(record)
            yield from (gateway_families if record.get("kind") == "gateway" else stage_families)(record)


def service_families(record: dict[str, Any]) -> Iterator[Any]:
    yield InfoMetricFamily("nebula_service", "the service this endpoint belongs to",
                           value={k: str(record.get(k, "")) for k in ("service", "kind", "address")})
    yield StateSetMetricFamily("nebula_service_state", "the service's state (as in its status file)",
                               value={state: record.get("state") == state for state in STATES})
    yield GaugeMetricFamily("nebula_service_start_time_seconds", "when the service started (unix time)",
                            value=record.get("started", 0))
    yield GaugeMetricFamily("nebula_service_numbers_stale", "1 while the service's numbers cannot be read (status "
                            "numbers_error): the others are the last ones read", value=int("numbers_error" in record))


def gateway_families(record: dict[str, Any]) -> Iterator[Any]:
    peers = record.get("peers", {})
    for what, unit in (("messages", ""), ("bytes", " (envelope and payload frames)")):
        family = CounterMetricFamily(f"nebula_gateway_{what}", f"{what} routed, per peer (a site, or one of "
                                     f"this site's stages) and direction{unit}", labels=["peer", "direction"])
        for peer, counts in sorted(peers.items()):
            for direction in ("in", "out"):
                family.add_metric([peer, direction], counts.get(f"{what}_{direction}", 0))
        yield family
    yield _counters("nebula_gateway_resend_requests", "go-back requests (ACK topic resend) received, per peer",
                    "peer", {p: c.get("resend_requests", 0) for p, c in peers.items()})
    yield _counters("nebula_gateway_refusals", "messages refused, per reason (the ERROR code the sender got)",
                    "reason", record.get("refusals", {}))
    yield _counters("nebula_gateway_dropped", "messages dropped because the next hop was full or down (the "
                    "sender resends), per next hop", "link", record.get("dropped", {}))
    yield _counters("nebula_gateway_rate_limited", "messages dropped because their sender was over its rate limit "
                    "(ERROR rate-limited), per sender", "sender", record.get("rate_limited", {}))
    yield _counters("nebula_gateway_handshakes", "CURVE handshakes decided by the authenticator, per result",
                    "result", record.get("handshakes", {}))
    sessions = CounterMetricFamily("nebula_gateway_sessions", "CURVE sessions (handshakes) per link: in, admitted "
                                   "per certified address; out, this gateway's links per peer site (a rekey is "
                                   "one more)", labels=["peer", "direction"])
    for direction, counts in sorted(record.get("sessions", {}).items()):
        for peer, n in sorted(counts.items()):
            sessions.add_metric([peer, direction], n)
    yield sessions
    held = GaugeMetricFamily("nebula_gateway_queued_bytes", "bytes handed to ZeroMQ for a next hop and not yet "
                             "written out (bounded by [gateway] queue_bytes)", labels=["hop"])
    for hop, n in sorted(record.get("queued_bytes", {}).items()):
        held.add_metric([hop], n)
    yield held
    depth = GaugeMetricFamily("nebula_gateway_queue_depth", "messages the gateway found waiting on a socket at its "
                              "last turn (a lower bound when it hit its per-turn batch)", labels=["socket"])
    for sock, n in sorted(record.get("queues", {}).items()):
        depth.add_metric([sock], n)
    yield depth


def stage_families(record: dict[str, Any]) -> Iterator[Any]:
    for key, name, help_ in (("step", "step", "last training step applied"),
                             ("loss", "loss", "loss of the last step"),
                             ("step_s", "step_seconds", "time of the last step, update to update"),
                             ("compute_s", "compute_seconds", "compute time of the last step"),
                             ("wire_s", "wire_seconds", "time of the last step not spent computing: waiting "
                                                        "for the wire and the other stages"),
                             ("in_flight", "in_flight_messages", "messages sent and not yet acknowledged")):
        if record.get(key) is not None:
            yield GaugeMetricFamily(f"nebula_stage_{name}", help_, value=record[key])
    for what in ("messages", "bytes"):
        family = CounterMetricFamily(f"nebula_stage_{what}", f"{what} through the stage's channel (payload and "
                                     "body bytes)", labels=["direction"])
        for direction in ("in", "out"):
            family.add_metric([direction], record.get(f"{what}_{direction}", 0))
        yield family
    yield CounterMetricFamily("nebula_stage_resent_messages", "messages the channel sent again",
                              value=record.get("resent", 0))
    yield CounterMetricFamily("nebula_stage_sessions", "CURVE sessions (handshakes) of the channel with its gateway: "
                              "the first, and one per rekey", value=record.get("handshakes", 0))
    links = record.get("links", {})
    ratio = GaugeMetricFamily("nebula_stage_codec_ratio", "raw bytes / wire bytes of what the stage encoded, per "
                              "link and direction", labels=["link", "direction", "codec"])
    wire = CounterMetricFamily("nebula_stage_wire_bytes", "encoded tensor bytes, per link and direction",
                               labels=["link", "direction"])
    cache = GaugeMetricFamily("nebula_stage_delta_cache_bytes", "rows `delta` keeps per link and direction, in "
                              "memory or spilled to disk (the sender's; the receiver holds the same)",
                              labels=["link", "direction", "where"])
    lookups = CounterMetricFamily("nebula_stage_delta_cache_lookups", "rows sent as a delta against a cached base "
                                  "(hit) or direct (miss)", labels=["link", "direction", "result"])
    for key, c in sorted(links.items()):
        link, direction = key.rsplit(":", 1)
        ratio.add_metric([link, direction, c.get("codec", "")], c.get("ratio", 0))
        wire.add_metric([link, direction], c.get("wire_bytes", 0))
        if "delta_cache" in c:
            for where, field in (("memory", "ram_bytes"), ("disk", "disk_bytes")):
                cache.add_metric([link, direction, where], c["delta_cache"][field])
            for result, field in (("hit", "hits"), ("miss", "misses")):
                lookups.add_metric([link, direction, result], c["delta_cache"][field])
    yield ratio
    yield wire
    yield cache
    yield lookups


def _counters(name: str, help_: str, label: str, values: Mapping[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family
