"""The replicas bench's spec (nebula.workload): `nebula bench wan --scenario replicas` (nebula_lab.bench.replicas).

A scenario of the lab's own, not a workload's: it replicates a workload's whole-model job (the GPT's by
default) and runs the peer a user would run instead. Declared as every scenario is, by a spec under the
entry-point group, so that the bench finds it as it finds the others; it imports nothing (`nebula --help`)."""
from nebula.workload import Workload

WORKLOAD = Workload(scenario="nebula_lab.bench.replicas:SCENARIO")
