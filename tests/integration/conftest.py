"""Fixtures for integration tests: real key stores, real gateway processes on random loopback ports
(helpers in tests/support/gateways.py). Every test is checked for leftover child processes (tests/conftest.py).
"""
from __future__ import annotations

import pytest

from tests.support.gateways import GatewayProcess, World, make_world


@pytest.fixture
def world(tmp_path) -> World:
    return make_world(tmp_path)


@pytest.fixture
def gateways(world, tmp_path, request):
    """Both gateways of `world` running; their log tails are printed if the test fails."""
    procs = {name: GatewayProcess(site).start() for name, site in world.sites.items()}
    yield procs
    for proc in procs.values():
        proc.kill()
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        for name, proc in procs.items():
            print(f"--- gateway {name} log tail ---\n{proc.tail()}")


@pytest.fixture
def running(request):
    """-> start(world, *sites): real gateway processes of the sites named, started on demand and killed at the
    end (log tails on failure); it returns the ones it started."""
    procs: list[GatewayProcess] = []

    def start(world, *names):
        for name in names:
            procs.append(GatewayProcess(world.site(name)).start())
        return procs[-len(names):]

    yield start
    for proc in procs:
        proc.kill()
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        for proc in procs:
            print(f"--- gateway {proc.site.name} log tail ---\n{proc.tail()}")
