"""The lab: benchmarks (`nebula bench`), WAN emulation and the delay line (`nebula wan`).

It sits above the framework and the workloads: it imports `nebula`, and reaches a workload only through
the scenario its spec names (nebula.workload); neither imports it (import contracts in pyproject.toml).
It plugs its commands in like any workload, with a spec of its own (nebula_lab/workload.py).
"""
