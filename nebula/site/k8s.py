"""A site's Kubernetes manifests, from its site config ([scheduler] kind = "kubernetes"): `nebula site k8s
CONFIG --out DIR` writes them, `kubectl apply -f DIR` runs them. Written, validated against the Kubernetes API
schemas and their network policies evaluated in the tests; never run under a cluster here (none can start on
the development host): docs/operate.md, "A site on Kubernetes".

    namespace.yaml      the site's namespace
    secrets.yaml        one Secret per service: its own credential directory, never the CA store
    config.yaml         the site config as the pods see it, and the job file
    storage.yaml        the run volume (ReadWriteMany): logs, status, checkpoints, the audit log
    gateway.yaml        the gateway: a Deployment, its external Service (the only one reachable from outside)
                        and its internal Service (the stages' endpoint)
    stage-<name>.yaml   a stage: a StatefulSet of its ranks and the headless Service its rank 0 is found by
    network.yaml        NetworkPolicies: nothing in or out but what follows; a stage reaches its gateway and
                        its own ranks only; the gateway is reached from outside on its external port only

A stage's pod k is rank k (the StatefulSet's pod index), under torchrun's conventions: RANK from the pod's
apps.kubernetes.io/pod-index label, WORLD_SIZE its ranks, MASTER_ADDR its pod 0 through the headless Service.
A StatefulSet restarts a pod that exits, so a stage that finished its job stays idle instead of starting again.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import tomli_w

from nebula.errors import ConfigError
from nebula.runtime.job import StageConfig
from nebula.security.certs import address_filename
from nebula.security.credentials import refuse_ca_key
from nebula.site.config import SiteConfig, gateway_config, site_table
from nebula.site.scheduler import SchedulerConfig

UID = 10001  # deploy/docker/Dockerfile's user
ETC, RUN, DATA = Path("/etc/nebula"), Path("/var/lib/nebula/run"), Path("/var/lib/nebula/data")
MASTER_PORT = 29500
APP = "app.kubernetes.io/name"  # every pod: "nebula"; "nebula.io/service": gateway or the stage's name


def manifests(site: SiteConfig, stages: dict[str, StageConfig]) -> dict[str, list[dict]]:
    """file name -> the objects it holds, for `site` running `stages` (name -> its config in the job)."""
    k8s = site.scheduler
    if k8s.kind != "kubernetes":
        raise ConfigError(f"{site.source} [scheduler] kind = {k8s.kind!r}: `site k8s` writes the manifests of a "
                          "site with kind = \"kubernetes\" (and its image); see docs/operate.md")
    ns = k8s.namespace or f"nebula-{site.name}"
    ports = _ports(site)
    services = {"gateway": site.gateway.address, **{name: s.address for name, s in stages.items()}}
    files = {"namespace.yaml": [_obj("v1", "Namespace", ns, None, {APP: "nebula", "nebula.io/site": site.name})],
             "secrets.yaml": [_secret(site, ns, name, address) for name, address in services.items()],
             "config.yaml": [_obj("v1", "ConfigMap", "site", ns, data={
                 "site.toml": pod_site_config(site, ns), "job.toml": Path(site.stages.job).read_text()
                 if site.stages.job else ""})],
             "storage.yaml": [_claim(k8s, ns)],
             "gateway.yaml": _gateway(site, ns, ports),
             "network.yaml": network_policies(ns, ports, list(stages))}
    for name, stage in stages.items():
        files[f"stage-{name}.yaml"] = _stage(site, ns, name, stage)
    return files


def _ports(site: SiteConfig) -> dict[str, int]:
    return {key: int(getattr(site.gateway, key).rsplit(":", 1)[1]) for key in ("internal", "external")}


def _obj(api: str, kind: str, name: str, ns: str | None, labels: dict[str, str] | None = None, **body: Any) -> dict:
    meta: dict[str, Any] = {"name": name, **({"namespace": ns} if ns else {}), "labels": labels or {APP: "nebula"}}
    return {"apiVersion": api, "kind": kind, "metadata": meta, **body}


def pod_site_config(site: SiteConfig, ns: str) -> str:
    """The site config as every pod reads it at /etc/nebula/site.toml: container paths, binds on the pod's
    addresses, the stages dialling the gateway's internal Service, no CA store, the scheduler left out."""
    ports = _ports(site)
    gateway = gateway_config(site.name, {**dataclasses.asdict(site.gateway), "internal": f"tcp://0.0.0.0:"
                                         f"{ports['internal']}", "external": f"tcp://0.0.0.0:{ports['external']}",
                                         "internal_connect": f"tcp://gateway-internal.{ns}.svc:{ports['internal']}"},
                             f"{site.source} [gateway]")
    pod = dataclasses.replace(site, ca=None, credentials=ETC / "credentials", run=RUN, audit=RUN / "audit" /
                              "gateway.jsonl", data=(DATA,) if site.scheduler.data_claim else (),
                              gateway=gateway, scheduler=SchedulerConfig(),
                              stages=dataclasses.replace(site.stages, job=ETC / "job" / "job.toml"
                                                         if site.stages.job else None))
    return tomli_w.dumps(site_table(pod, ETC))  # mounted at /etc/nebula/site.toml: paths relative to /etc/nebula


def _secret(site: SiteConfig, ns: str, name: str, address: str) -> dict:
    """Service `name`'s own credential directory (its key, certificates, trust; never ca.key), one key per file."""
    where = site.credentials_for(address)
    if not (where / "ca.pub").exists():
        raise ConfigError(f"no credentials for {address} in {where}: `nebula site init` (or `nebula keys "
                          f"bundle-service {address} --dir CA_ROOT --out {where}`) writes them first")
    refuse_ca_key(where)
    files = sorted(p.relative_to(where).as_posix() for p in where.rglob("*") if p.is_file())
    return _obj("v1", "Secret", f"{name}-credentials", ns, {APP: "nebula", "nebula.io/service": name},
                type="Opaque", stringData={_secret_key(f): (where / f).read_text() for f in files})


def _secret_key(path: str) -> str:
    return path.replace("/", "__")  # a Secret's keys hold no '/': certs/x.json -> certs__x.json


def _claim(k8s: SchedulerConfig, ns: str) -> dict:
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": k8s.run_size}}}
    if k8s.storage_class:
        spec["storageClassName"] = k8s.storage_class
    return _obj("v1", "PersistentVolumeClaim", "run", ns, spec=spec)


# -- pods ------------------------------------------------------------------------------------------------------------
def _pod(site: SiteConfig, name: str, address: str, args: list[str], env: dict[str, Any], gpus: int) -> dict:
    """A pod of service `name`: its credentials copied from its Secret to a 0600 directory (a Secret's files are
    group-readable under fsGroup, which nebula refuses for a key), unprivileged, read-only, health-probed."""
    k8s, creds = site.scheduler, ETC / "credentials" / address_filename(address)
    files = sorted(_secret_files(site, address))
    copy = " && ".join(f"install -D -m 600 /secret/{f} {creds}/{f}" for f in files)
    mounts = [{"name": "config", "mountPath": str(ETC / "site.toml"), "subPath": "site.toml", "readOnly": True},
              {"name": "config", "mountPath": str(ETC / "job" / "job.toml"), "subPath": "job.toml", "readOnly": True},
              {"name": "credentials", "mountPath": str(ETC / "credentials")},
              {"name": "run", "mountPath": str(RUN)}, {"name": "tmp", "mountPath": "/tmp"}]
    volumes = [{"name": "config", "configMap": {"name": "site"}},
               {"name": "secret", "secret": {"secretName": f"{name}-credentials", "defaultMode": 0o400,
                                             "items": [{"key": _secret_key(f), "path": f} for f in files]}},
               {"name": "credentials", "emptyDir": {"medium": "Memory"}},
               {"name": "run", "persistentVolumeClaim": {"claimName": "run"}}, {"name": "tmp", "emptyDir": {}}]
    if k8s.data_claim:
        mounts.append({"name": "data", "mountPath": str(DATA), "readOnly": True})
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": k8s.data_claim, "readOnly": True}})
    resources = {"cpu": k8s.cpu, "memory": k8s.memory, **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    hardened = {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    probe = {"exec": {"command": ["nebula", "health", str(ETC / "site.toml"), "--service", name]},
             "periodSeconds": 10, "failureThreshold": 6}
    envs = [{"name": "HOME", "value": "/tmp"}, {"name": "NEBULA_SERVICE", "value": name},
            {"name": "NEBULA_STATUS_FILE", "value": str(RUN / "status" / f"{name}.json")},
            {"name": "NEBULA_ADDRESS", "value": address},
            *({"name": k, **({"value": v} if isinstance(v, str) else v)} for k, v in env.items())]
    return {"metadata": {"labels": {APP: "nebula", "nebula.io/site": site.name, "nebula.io/service": name}},
            "spec": {"securityContext": {"fsGroup": UID, "seccompProfile": {"type": "RuntimeDefault"}},
                     "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 60,
                     "initContainers": [{"name": "credentials", "image": k8s.image, "command": ["sh", "-c", copy],
                                         "securityContext": hardened, "volumeMounts": [
                                             {"name": "secret", "mountPath": "/secret", "readOnly": True},
                                             {"name": "credentials", "mountPath": str(ETC / "credentials")}]}],
                     "containers": [{"name": name, "image": k8s.image, "args": args, "env": envs,
                                     "resources": {"requests": resources, "limits": resources},
                                     "securityContext": hardened, "volumeMounts": mounts,
                                     "readinessProbe": probe, "livenessProbe": {**probe, "initialDelaySeconds": 60}}],
                     "volumes": volumes}}


def _secret_files(site: SiteConfig, address: str) -> list[str]:
    where = site.credentials_for(address)
    return [p.relative_to(where).as_posix() for p in where.rglob("*") if p.is_file()]


def _gateway(site: SiteConfig, ns: str, ports: dict[str, int]) -> list[dict]:
    select = {"nebula.io/service": "gateway"}
    pod = _pod(site, "gateway", site.gateway.address, ["gateway", "run", "--site-config", str(ETC / "site.toml")],
               {}, gpus=0)
    pod["spec"]["containers"][0]["ports"] = [{"name": "external", "containerPort": ports["external"]},
                                             {"name": "internal", "containerPort": ports["internal"]}]
    deployment = _obj("apps/v1", "Deployment", "gateway", ns, spec={
        "replicas": 1, "strategy": {"type": "Recreate"},  # one gateway per site: never two during an update
        "selector": {"matchLabels": select}, "template": pod})
    external = _obj("v1", "Service", "gateway", ns, spec={
        "type": site.scheduler.service_type, "selector": select,
        "ports": [{"name": "external", "port": ports["external"], "targetPort": ports["external"]}]})
    internal = _obj("v1", "Service", "gateway-internal", ns, spec={
        "type": "ClusterIP", "selector": select,
        "ports": [{"name": "internal", "port": ports["internal"], "targetPort": ports["internal"]}]})
    return [deployment, external, internal]


def _stage(site: SiteConfig, ns: str, name: str, stage: StageConfig) -> list[dict]:
    select = {"nebula.io/service": name}
    workdir = RUN / name
    run = (f"nebula stage run --job {ETC / 'job' / 'job.toml'} --stage {name} --site {ETC / 'site.toml'} "
           f"--workdir {workdir}")
    # a finished stage (finished.json in its workdir) stays idle: started again it would evaluate again and wait
    # for the other sites, and a StatefulSet restarts whatever exits
    script = (f'if [ -e {workdir}/finished.json ]; then echo "stage {name} finished its job; scale its '
              f'StatefulSet to 0"; exec sleep infinity; fi; exec {run}')
    env = {"RANK": {"valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}},
           "LOCAL_RANK": "0", "WORLD_SIZE": str(stage.ranks), "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": f"{name}-0.{name}.{ns}.svc", "MASTER_PORT": str(MASTER_PORT)}
    pod = _pod(site, name, stage.address, [], env, gpus=site.scheduler.gpus_per_rank)
    container = pod["spec"]["containers"][0]
    container.update(command=["sh", "-c", script], ports=[{"name": "rendezvous", "containerPort": MASTER_PORT}])
    del container["args"]
    headless = _obj("v1", "Service", name, ns, spec={
        "clusterIP": "None", "publishNotReadyAddresses": True,  # rank 0 is found before it is ready
        "selector": select, "ports": [{"name": "rendezvous", "port": MASTER_PORT}]})
    ranks = _obj("apps/v1", "StatefulSet", name, ns, spec={
        "serviceName": name, "replicas": stage.ranks, "podManagementPolicy": "Parallel",  # ranks start together
        "selector": {"matchLabels": select}, "template": pod})
    return [headless, ranks]


# -- network policies ------------------------------------------------------------------------------------------------
def network_policies(ns: str, ports: dict[str, int], stages: list[str]) -> list[dict]:
    """Deny everything in the namespace, then allow: DNS out of every pod; the gateway in from anywhere on its
    external port and from the stages on its internal one, out to anywhere (the peers' gateways); each stage out
    to the gateway's internal port and to its own ranks, in from its own ranks."""
    dns = {"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
           "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    gateway = {"matchLabels": {"nebula.io/service": "gateway"}}
    policies = [_policy(ns, "default-deny", {}, ingress=[], egress=[dns]),
                _policy(ns, "gateway", gateway, ingress=[
                    {"ports": [{"protocol": "TCP", "port": ports["external"]}]},
                    {"from": [{"podSelector": {"matchExpressions": [
                        {"key": "nebula.io/service", "operator": "In", "values": stages}]}}] if stages else [],
                     "ports": [{"protocol": "TCP", "port": ports["internal"]}]}],
                    egress=[{"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}]}])]
    for name in stages:
        own = {"matchLabels": {"nebula.io/service": name}}
        policies.append(_policy(ns, f"stage-{name}", own, ingress=[{"from": [{"podSelector": own}]}], egress=[
            {"to": [{"podSelector": gateway}], "ports": [{"protocol": "TCP", "port": ports["internal"]}]},
            {"to": [{"podSelector": own}]}]))
    return policies


def _policy(ns: str, name: str, pods: dict, ingress: list[dict], egress: list[dict]) -> dict:
    return _obj("networking.k8s.io/v1", "NetworkPolicy", name, ns, spec={
        "podSelector": pods, "policyTypes": ["Ingress", "Egress"], "ingress": ingress, "egress": egress})


# -- writing ---------------------------------------------------------------------------------------------------------
def write_manifests(files: dict[str, list[dict]], out: Path) -> list[Path]:
    """Each file as YAML documents under `out` (created); -> the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, objects in files.items():
        path = out / name
        path.write_text("".join(f"---\n{to_yaml(obj)}" for obj in objects))
        written.append(path)
    return written


def to_yaml(value: Any, indent: int = 0) -> str:
    """`value` (dicts, lists, str, int, bool, None) as block YAML: strings double-quoted as JSON writes them
    (valid YAML), text of several lines as a literal block, so a ConfigMap's file reads as the file."""
    pad = " " * indent
    if isinstance(value, dict) and value:
        return "".join(f"{pad}{_key(k)}:{_after_key(v, indent)}" for k, v in value.items())
    if isinstance(value, list) and value:
        items = []
        for v in value:
            if isinstance(v, (dict, list)) and v:
                body = to_yaml(v, indent + 2)  # its first line's indent becomes the dash
                items.append(f"{pad}- {body[indent + 2:]}")
            else:
                items.append(f"{pad}- {_scalar(v)}\n")
        return "".join(items)
    return f"{pad}{_scalar(value)}\n"


def _after_key(value: Any, indent: int) -> str:
    if isinstance(value, (dict, list)) and value:
        return "\n" + to_yaml(value, indent + 2)
    if isinstance(value, str) and _literal(value):
        return " |\n" + "".join(f"{' ' * (indent + 2)}{line}\n" if line else "\n" for line in value.splitlines())
    return f" {_scalar(value)}\n"


def _literal(text: str) -> bool:
    """Whether a literal block keeps `text` exactly: lines, one final newline, no edge whitespace."""
    lines = text.splitlines()
    return (len(lines) > 1 and text.endswith("\n") and not text.endswith("\n\n") and not lines[0].startswith(" ")
            and all(line == line.rstrip() and "\t" not in line and "\r" not in line for line in lines))


_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
_WORDS = {"true", "false", "null", "yes", "no", "on", "off", "y", "n", "~"}


def _key(key: str) -> str:
    return key if _PLAIN.fullmatch(key) and key.lower() not in _WORDS else json.dumps(key)


def _scalar(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return "{}" if isinstance(value, dict) else "[]"
    return json.dumps(value)
