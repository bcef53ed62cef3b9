"""The lab's spec (nebula.workload): the commands `nebula bench` and `nebula wan`, and nothing else.

The lab plugs in as a workload does, through the one entry-point group: the framework finds these
commands there and never imports the lab (an import contract holds it), so an installation without
the lab is a framework without them, not a broken one.
"""
from nebula.workload import Workload

WORKLOAD = Workload(commands={"bench": "nebula_lab.bench_command:register",
                              "wan": "nebula_lab.wan_command:register"})
