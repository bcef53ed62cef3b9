"""A site config's [scheduler] table: where `nebula site up` runs the site's stages.

    [scheduler]
    kind = "slurm"              # default "local": processes of `site up`'s own supervisor on this host
    partition = "gpu"           # sbatch --partition (default: the cluster's default partition)
    account = "nebula"          # sbatch --account
    time = "2-00:00:00"         # sbatch --time: a job's time limit (it is resubmitted when it runs out)
    gpus_per_rank = 1           # sbatch --gpus-per-task
    ranks_per_node = 8          # a stage's ranks per node (default: all of them on one node)
    sbatch = ["--qos=high"]     # more sbatch options, as sbatch reads them
    gateway = "edge"            # "edge": beside `site up` on this host; "job": a job of its own on gateway_node
    max_resubmits = 5           # a stage job that fails or is preempted this often in a row stays failed
    poll = 5.0                  # seconds between two queries of the scheduler (squeue, sacct)

    [scheduler]
    kind = "kubernetes"         # `nebula site k8s CONFIG --out DIR` writes the site's manifests; kubectl applies them
    image = "registry.example.org/nebula:0.1.0"   # deploy/docker/Dockerfile's image
    namespace = "nebula-b"      # default nebula-<site>
    cpu = "4"                   # requests and limits of each rank's (and the gateway's) container
    memory = "16Gi"
    gpus_per_rank = 1           # nvidia.com/gpu
    storage_class = "cephfs"    # the run volume's class: ReadWriteMany, shared by every pod of the site
    run_size = "200Gi"
    data_claim = "datasets"     # an existing claim with the site's data, read-only at /var/lib/nebula/data
    service_type = "LoadBalancer"   # how the gateway's external port is exposed (or "NodePort")

nebula.site.slurm submits and watches the jobs; docs/operate.md, "A site on Slurm", is the operator's view;
nebula.site.k8s writes the manifests ("A site on Kubernetes").
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from nebula.config import limits
from nebula.errors import ConfigError

# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (sbatch(1)); "UNLIMITED" too
_TIME = re.compile(r"(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}|UNLIMITED)")
_SLURM_ONLY = ("partition", "account", "time", "ranks_per_node", "gateway_node")
_K8S_ONLY = ("image", "namespace", "cpu", "memory", "storage_class", "run_size", "data_claim")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    kind: Literal["local", "slurm", "kubernetes"] = "local"
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    gpus_per_rank: int = field(default=0, metadata=limits(at_least=0))
    ranks_per_node: int | None = field(default=None, metadata=limits(at_least=1))
    sbatch: tuple[str, ...] = ()
    gateway: Literal["edge", "job"] = "edge"
    gateway_node: str | None = None
    max_resubmits: int = field(default=5, metadata=limits(at_least=0))
    poll: float = field(default=5.0, metadata=limits(above=0, hint="seconds between two squeue queries"))
    image: str | None = None
    namespace: str | None = None
    cpu: str = "1"
    memory: str = "4Gi"
    storage_class: str | None = None
    run_size: str = "20Gi"
    data_claim: str | None = None
    service_type: Literal["LoadBalancer", "NodePort"] = "LoadBalancer"

    def __post_init__(self) -> None:
        slurm = [k for k in _SLURM_ONLY if getattr(self, k) is not None] + (["sbatch"] if self.sbatch else []) + \
            (["gateway"] if self.gateway != "edge" else [])
        k8s = [k for k in _K8S_ONLY if getattr(self, k) != SchedulerConfig.__dataclass_fields__[k].default]
        k8s += ["service_type"] if self.service_type != "LoadBalancer" else []
        for kind, keys in (("slurm", k8s if self.kind == "slurm" else []), ("kubernetes", slurm if self.kind ==
                           "kubernetes" else []), ("slurm", slurm if self.kind == "local" else []),
                           ("kubernetes", k8s if self.kind == "local" else [])):
            if keys:
                raise ConfigError(f"`{keys[0]}` is an option of kind = \"{kind}\", not of kind = \"{self.kind}\": "
                                  f"set kind = \"{kind}\" or remove it")
        if self.kind == "local" and self.gpus_per_rank:
            raise ConfigError("`gpus_per_rank` is an option of kind = \"slurm\" or \"kubernetes\"; with kind = "
                              "\"local\" (the default) a stage's [stages.NAME] device chooses its GPU")
        if self.kind == "kubernetes" and not self.image:
            raise ConfigError("kind = \"kubernetes\" needs `image`: the image of deploy/docker/Dockerfile as your "
                              "cluster pulls it, e.g. image = \"registry.example.org/nebula:0.1.0\"")
        if self.time is not None and not _TIME.fullmatch(self.time):
            raise ConfigError(f"`time` = {self.time!r} is not a Slurm time limit: write minutes, \"HH:MM:SS\" or "
                              "\"D-HH:MM:SS\" (e.g. \"2:00:00\", \"1-00:00:00\")")
        if self.gateway == "job" and not self.gateway_node:
            raise ConfigError("`gateway` = \"job\" runs the gateway as a Slurm job pinned to a node: name it with "
                              "gateway_node = \"NODE\" (its [gateway] internal address must be that node's)")
        if self.gateway == "edge" and self.gateway_node is not None:
            raise ConfigError("`gateway_node` pins the gateway's job to a node, but `gateway` is \"edge\" (it runs "
                              "beside `site up`): set gateway = \"job\" or remove gateway_node")
        for option in self.sbatch:
            if not option.startswith("-"):
                raise ConfigError(f"`sbatch` option {option!r} is not an option: write each as sbatch reads it, "
                                  "e.g. \"--qos=high\"")

    @property
    def slurm(self) -> bool:
        return self.kind == "slurm"

    def site_up(self, source: str) -> None:
        """`site up` runs local processes and Slurm jobs; a Kubernetes site is applied with kubectl."""
        if self.kind == "kubernetes":
            raise ConfigError(f"{source} [scheduler] kind = \"kubernetes\": `nebula site k8s {source} --out DIR` "
                              "writes the site's manifests and `kubectl apply -f DIR` runs them; `site up` runs "
                              "kind = \"local\" or \"slurm\"")
