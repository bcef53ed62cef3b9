"""The GPT workload's spec (nebula.workload): a language model split into pipeline stages across sites,
and its time-to-loss bench scenario (docs/gpt.md)."""
from nebula.workload import Workload

WORKLOAD = Workload(
    stages={"gpt-first": "services.gpt.stages:GptFirst",
            "gpt-middle": "services.gpt.stages:GptMiddle",
            "gpt-last": "services.gpt.stages:GptLast",
            "gpt-whole": "services.gpt.stages:GptWhole"},
    scenario="services.gpt.bench:SCENARIO",
)
