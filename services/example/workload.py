"""The example workload's spec (nebula.workload): three small stages, what the framework's tests train."""
from nebula.workload import Workload

WORKLOAD = Workload(stages={"example-source": "services.example.stages:Source",
                            "example-middle": "services.example.stages:Middle",
                            "example-sink": "services.example.stages:Sink"})
