"""The split workload's spec (nebula.workload): one stage implementation for any model (`impl = "split"`),
`nebula split verify` and `nebula split bench`, and `nebula data prepare-pairs` (a classification task
from the parallel corpus)."""
from nebula.workload import Workload

WORKLOAD = Workload(
    stages={"split": "services.split.stage:SplitStage"},
    commands={"split": "services.split.command:register"},
    data={"prepare-pairs": "services.split.pairs:register"},
    scenario="services.split.peer:SCENARIO",  # a peer only: `nebula bench wan --scenario replicas --workload split`
)
