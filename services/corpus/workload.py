"""The corpus tooling's spec (nebula.workload): `nebula data prepare`, beside the framework's data actions."""
from nebula.workload import Workload

WORKLOAD = Workload(data={"prepare": "services.corpus.command:register"})
