"""`nebula site k8s`: a site's Kubernetes manifests, written from a site that `nebula site init` made, validated
against the Kubernetes API schemas (kubernetes-validate, strict: no field the API does not know), and their
NetworkPolicies evaluated pod to pod (tests/support/netpol.py). No cluster runs them here; docs/operate.md says so.
The site runs both stages of the tiny job, the decoder with 2 ranks, so that a stage's neighbours are checked too."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import tomllib
import yaml

from nebula.errors import ConfigError
from nebula.site.builder import init_site
from nebula.site.config import load_site_config, parse_site_config
from nebula.site.k8s import MASTER_PORT, manifests, to_yaml, write_manifests
from nebula.site.site import stages_here
from tests.support.netpol import Endpoint, Policies
from tests.support.sites import write_job

K8S_VERSION = "1.37.0"  # the newest schemas kubernetes-validate ships; the pod-index label needs >= 1.28
SCHEDULER = """
[scheduler]
kind = "kubernetes"
image = "registry.example.org/nebula:0.1.0"
namespace = "nebula-b"
cpu = "4"
memory = "16Gi"
gpus_per_rank = 1
storage_class = "cephfs"
data_claim = "datasets"
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("k8s")
    job = write_job(root / "job", {'address = "a/encoder/0"': 'address = "b/encoder/0"',
                                   'address = "b/decoder/0"': 'address = "b/decoder/0"\nranks = 2'})
    init_site("b", root / "b", "tcp://b.example.org:5700", None, "tcp://127.0.0.1:5701", job, 1,
              ["b/encoder/0", "b/decoder/0"])
    config = root / "b" / "site.toml"
    config.write_text(config.read_text() + SCHEDULER)
    return config


@pytest.fixture(scope="module")
def written(site, tmp_path_factory) -> dict[str, list[dict]]:
    """The files `nebula site k8s` writes, read back as a YAML parser reads them."""
    out = tmp_path_factory.mktemp("manifests")
    done = subprocess.run([sys.executable, "-m", "nebula.cli", "site", "k8s", str(site), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return {p.name: list(yaml.safe_load_all(p.read_text())) for p in sorted(out.glob("*.yaml"))}


def objects(written, kind: str | None = None) -> list[dict]:
    return [o for docs in written.values() for o in docs if kind is None or o["kind"] == kind]


def test_the_files_are_what_the_generator_made_read_back_exactly(site, written, tmp_path):
    config = load_site_config(site)
    assert written == manifests(config, stages_here(config))
    assert set(written) == {"namespace.yaml", "secrets.yaml", "config.yaml", "storage.yaml", "gateway.yaml",
                            "network.yaml", "stage-encoder.yaml", "stage-decoder.yaml"}


def test_every_object_is_valid_against_the_kubernetes_api_schemas(written):
    for obj in objects(written):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises ValidationError, naming the field


def test_the_validation_is_not_vacuous():
    """A field the API does not know, and a wrong type, are refused by the same check."""
    pod = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"portz": []}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    pod["spec"] = {"ports": [{"port": "many"}]}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def pod_templates(written) -> dict[str, dict]:
    """service -> its pod template (the gateway's Deployment, each stage's StatefulSet)."""
    return {o["metadata"]["name"]: o["spec"]["template"] for o in objects(written)
            if o["kind"] in ("Deployment", "StatefulSet")}


def test_each_service_mounts_only_its_own_credentials_and_no_secret_holds_the_ca_key(site, written):
    ca_key = (site.parent / "keys" / "b" / "ca.key").read_bytes().decode(errors="replace").strip()
    secrets = {s["metadata"]["name"]: s["stringData"] for s in objects(written, "Secret")}
    assert set(secrets) == {"gateway-credentials", "encoder-credentials", "decoder-credentials"}
    for name, files in secrets.items():
        service = name.removesuffix("-credentials")
        address = {"gateway": "b.gateway.0", "encoder": "b.encoder.0", "decoder": "b.decoder.0"}[service]
        assert [k for k in files if k.endswith(".key")] == [f"keys__{address}.key"], name  # its own key only
        assert not any("ca.key" in k or ca_key in v for k, v in files.items()), name
    for service, pod in pod_templates(written).items():
        mounted = {v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
        assert mounted == {f"{service}-credentials"}, service


def test_only_the_gateway_is_exposed_outside_the_cluster(written):
    exposed = {s["metadata"]["name"]: s["spec"]["type"] for s in objects(written, "Service")
               if s["spec"].get("type", "ClusterIP") not in ("ClusterIP",)}
    assert exposed == {"gateway": "LoadBalancer"}
    headless = {s["metadata"]["name"] for s in objects(written, "Service") if s["spec"].get("clusterIP") == "None"}
    assert headless == {"encoder", "decoder"}


def test_a_stage_is_its_ranks_with_torchruns_variables_and_rank_0_behind_its_headless_service(written):
    decoder = next(o for o in objects(written, "StatefulSet") if o["metadata"]["name"] == "decoder")
    assert decoder["spec"]["replicas"] == 2 and decoder["spec"]["serviceName"] == "decoder"
    container = decoder["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "decoder-0.decoder.nebula-b.svc"
    assert env["RANK"] == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert container["image"] == "registry.example.org/nebula:0.1.0"
    assert container["resources"]["limits"] == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}
    assert "finished.json" in container["command"][2] and "nebula stage run" in container["command"][2]


def test_the_pods_site_config_loads_with_container_paths_and_no_ca(written):
    config = next(o for o in objects(written, "ConfigMap"))["data"]
    site = parse_site_config(tomllib.loads(config["site.toml"]), base=Path("/etc/nebula"), source="site.toml")
    assert site.ca is None and str(site.credentials) == "/etc/nebula/credentials"
    assert site.gateway.internal_connect == "tcp://gateway-internal.nebula-b.svc:5701"
    assert site.scheduler.kind == "local" and [str(d) for d in site.data] == ["/var/lib/nebula/data"]
    assert "[stages.decoder]" in config["job.toml"]


def endpoints(written) -> dict[str, Endpoint]:
    """Every pod the manifests make (a stage's ranks each), a pod of another namespace, DNS, and two hosts outside."""
    found, ip = {}, 10
    for name, pod in pod_templates(written).items():
        replicas = next(o["spec"]["replicas"] for o in objects(written) if o["metadata"]["name"] == name
                        and o["kind"] in ("Deployment", "StatefulSet"))
        for k in range(replicas):
            labels = {**pod["metadata"]["labels"], "apps.kubernetes.io/pod-index": str(k)}
            ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0].get("ports", [])}
            found[f"{name}-{k}"] = Endpoint(f"{name}-{k}", f"10.0.0.{ip}", "nebula-b", labels, ports)
            ip += 1
    found["other-ns"] = Endpoint("other-ns", "10.0.1.1", "default", {"app": "x"})
    found["dns"] = Endpoint("dns", "10.0.2.1", "kube-system", {"k8s-app": "kube-dns"})
    found["peer-gateway"] = Endpoint("peer-gateway", "203.0.113.5")  # site a's gateway, outside the cluster
    found["internet"] = Endpoint("internet", "198.51.100.7")
    return found


def test_network_policies_let_a_stage_reach_only_its_gateway_and_its_own_ranks(written):
    policies = Policies(objects(written, "NetworkPolicy"), {"nebula-b": {}, "default": {}, "kube-system": {}})
    pods = endpoints(written)
    external, internal = 5700, 5701
    stages = [n for n in pods if n.startswith(("encoder", "decoder"))]
    assert sorted(stages) == ["decoder-0", "decoder-1", "encoder-0"]
    for name in stages:
        src = pods[name]
        reachable = {(dst, port) for dst in pods for port in (external, internal, MASTER_PORT, 443, 53)
                     if dst != name and policies.reaches(src, pods[dst], port)}
        own = {(n, p) for n in stages if n != name and n.split("-")[0] == name.split("-")[0]
               for p in (external, internal, MASTER_PORT, 443, 53)}
        assert reachable == {("gateway-0", internal), ("dns", 53)} | own, name  # DNS: UDP and TCP
        assert policies.reaches(src, pods["dns"], 53, "UDP")
    assert policies.reaches(pods["decoder-1"], pods["decoder-0"], MASTER_PORT)  # rank 1 meets rank 0


def test_from_outside_only_the_gateways_external_port_is_reached(written):
    policies = Policies(objects(written, "NetworkPolicy"), {"nebula-b": {}, "default": {}, "kube-system": {}})
    pods = endpoints(written)
    for outside in ("peer-gateway", "internet", "other-ns"):
        reached = {(dst, port) for dst in ("gateway-0", "encoder-0", "decoder-0") for port in (5700, 5701, MASTER_PORT)
                   if policies.reaches(pods[outside], pods[dst], port)}
        assert reached == {("gateway-0", 5700)}, outside
    assert policies.reaches(pods["gateway-0"], pods["peer-gateway"], 5600)  # it dials the other sites
    assert not policies.reaches(pods["gateway-0"], pods["decoder-0"], MASTER_PORT)


def test_the_evaluator_follows_the_api_on_what_the_site_does_not_use():
    """Selector operators, namespace selectors and ipBlock exceptions, on a small policy of their own."""
    policy = {"metadata": {"namespace": "n"}, "spec": {
        "podSelector": {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["db"]}]},
        "policyTypes": ["Ingress"], "ingress": [{"from": [
            {"namespaceSelector": {"matchLabels": {"team": "ml"}}, "podSelector": {"matchExpressions": [
                {"key": "role", "operator": "Exists"}]}},
            {"ipBlock": {"cidr": "192.0.2.0/24", "except": ["192.0.2.128/25"]}}],
            "ports": [{"protocol": "TCP", "port": 8000, "endPort": 8010}]}]}}
    policies = Policies([policy], {"n": {}, "ml": {"team": "ml"}, "web": {}})
    web, db = Endpoint("web", "10.0.0.1", "n", {"tier": "web"}), Endpoint("db", "10.0.0.2", "n", {"tier": "db"})
    trainer = Endpoint("t", "10.0.1.1", "ml", {"role": "trainer"})
    assert policies.reaches(trainer, web, 8005) and not policies.reaches(trainer, web, 8011)
    assert not policies.reaches(Endpoint("u", "10.0.2.1", "web", {"role": "x"}), web, 8005)
    assert not policies.reaches(Endpoint("u", "10.0.1.2", "ml", {}), web, 8005)  # no `role`
    assert policies.reaches(Endpoint("h", "192.0.2.7"), web, 8000)
    assert not policies.reaches(Endpoint("h", "192.0.2.200"), web, 8000)  # the exception
    assert policies.reaches(Endpoint("h", "198.51.100.1"), db, 1)  # db is selected by no policy: open


def test_the_yaml_writer_round_trips_what_a_manifest_holds(tmp_path):
    value = {"a": [1, {"b": "x: y", "c": [True, None, "2"]}, [3, []]], "on": "no", "text": "one\n  two\n\nthree\n",
             "edge": " lead\n", "twice": "a\n\n", "empty": {}, "k/v.w-x_y": "\u00e9"}
    assert yaml.safe_load(to_yaml(value)) == value
    write_manifests({"x.yaml": [value, value]}, tmp_path)
    assert list(yaml.safe_load_all((tmp_path / "x.yaml").read_text())) == [value, value]


def test_site_k8s_and_site_up_each_refuse_the_other_kind(site, tmp_path):
    config = load_site_config(site)
    with pytest.raises(ConfigError, match="`kubectl apply -f DIR` runs them"):
        config.scheduler.site_up(str(site))
    slurm = tmp_path / "slurm.toml"
    slurm.write_text(site.read_text().split("\n[scheduler]")[0] + '\n[scheduler]\nkind = "slurm"\n')
    with pytest.raises(ConfigError, match="writes the manifests of a site with kind = \"kubernetes\""):
        manifests(load_site_config(slurm), {})
