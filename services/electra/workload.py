"""ELECTRA-Cloud's spec (nebula.workload): its two stages, `nebula demo electra`, its bench scenario,
`nebula electra eval`."""
from nebula.workload import Workload

WORKLOAD = Workload(
    stages={"electra-generator": "services.electra.stages:ElectraGenerator",
            "electra-discriminator": "services.electra.stages:ElectraDiscriminator"},
    demo="services.electra.demo:DEMO",
    scenario="services.electra.bench:SCENARIO",
    commands={"electra": "services.electra.command:register"},
)
