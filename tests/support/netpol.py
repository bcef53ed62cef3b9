"""Which pods may reach which, from NetworkPolicy objects as the Kubernetes API defines them (networking.k8s.io/v1):
no cluster, only the manifests. A connection from A to B on a port is allowed when A's egress and B's ingress both
allow it; a direction no policy selecting the pod restricts is open; the rules of every policy that selects the
pod add up. Peers: podSelector (in the policy's namespace), namespaceSelector, both (pods matching in matching
namespaces), ipBlock (with except). An ipBlock is matched against every endpoint's IP, pods' included: what
some network plugins do, so a policy this evaluator finds tight is tight under all of them."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Endpoint:
    name: str
    ip: str
    namespace: str | None = None  # None: outside the cluster
    labels: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)  # named container ports


def matches(selector: dict | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions); an empty one selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


class Policies:
    def __init__(self, policies: list[dict], namespaces: dict[str, dict[str, str]]):
        self.policies = policies
        # every namespace carries kubernetes.io/metadata.name (the API server sets it)
        self.namespaces = {ns: {**labels, "kubernetes.io/metadata.name": ns} for ns, labels in namespaces.items()}

    def _selecting(self, pod: Endpoint, kind: str) -> list[dict]:
        if pod.namespace is None:
            return []
        return [p for p in self.policies if p["metadata"]["namespace"] == pod.namespace
                and kind in p["spec"].get("policyTypes", ["Ingress"]) and matches(p["spec"]["podSelector"], pod.labels)]

    def _peer(self, peer: dict, other: Endpoint, policy_ns: str) -> bool:
        if "ipBlock" in peer:
            ip = ipaddress.ip_address(other.ip)
            block = peer["ipBlock"]
            inside = ip.version == ipaddress.ip_network(block["cidr"]).version and ip in ipaddress.ip_network(
                block["cidr"])
            return inside and not any(ip.version == ipaddress.ip_network(x).version and ip in ipaddress.ip_network(x)
                                      for x in block.get("except", []))
        if other.namespace is None:
            return False  # pod and namespace selectors name pods
        if "namespaceSelector" in peer:
            if not matches(peer["namespaceSelector"], self.namespaces.get(other.namespace, {})):
                return False
        elif other.namespace != policy_ns:
            return False
        return matches(peer.get("podSelector"), other.labels)

    def _port(self, ports: list[dict] | None, target: Endpoint, protocol: str, port: int) -> bool:
        if not ports:
            return True
        for p in ports:
            if p.get("protocol", "TCP") != protocol:
                continue
            if "port" not in p:
                return True
            number = target.ports.get(p["port"]) if isinstance(p["port"], str) else p["port"]
            if number is not None and number <= port <= p.get("endPort", number):
                return True
        return False

    def _allowed(self, pod: Endpoint, other: Endpoint, kind: str, target: Endpoint, protocol: str, port: int) -> bool:
        selecting = self._selecting(pod, kind)
        if not selecting:
            return True
        side = "egress" if kind == "Egress" else "ingress"
        peers = "to" if kind == "Egress" else "from"
        return any(self._port(rule.get("ports"), target, protocol, port)
                   and (not rule.get(peers) or any(self._peer(x, other, p["metadata"]["namespace"])
                                                   for x in rule[peers]))
                   for p in selecting for rule in p["spec"].get(side, []))

    def reaches(self, src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> bool:
        return (self._allowed(src, dst, "Egress", dst, protocol, port)
                and self._allowed(dst, src, "Ingress", dst, protocol, port))
