"""The corpus tooling's spec (nebula.workload): `nebula data prepare` (parallel text) and `nebula data
prepare-text` (English text for the GPT workload), beside the framework's data actions."""
from nebula.workload import Workload

WORKLOAD = Workload(data={"prepare": "services.corpus.command:register",
                          "prepare-text": "services.corpus.lm:register"})
