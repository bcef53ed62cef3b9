"""What tests share, imported by them: sites and gateways, whole jobs, the example workload's jobs built in
code, fault-injecting stages, and the programs some tests run as processes (`python -m tests.support.NAME`).
Fixtures stay in the conftest.py files; a test module imports no other test module."""
