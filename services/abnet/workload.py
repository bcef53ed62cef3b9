"""ABNet-Cloud's spec (nebula.workload): its two stages, `nebula demo`, its bench scenario, `nebula translate`."""
from nebula.workload import Workload

WORKLOAD = Workload(
    stages={"abnet-encoder": "services.abnet.stages:AbnetEncoder",
            "abnet-decoder": "services.abnet.stages:AbnetDecoder"},
    demo="services.abnet.demo:DEMO",
    scenario="services.abnet.bench:SCENARIO",
    commands={"translate": "services.abnet.translate:register"},
)
