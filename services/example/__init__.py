"""A minimal workload: three small stage modules (source -> middle -> sink) on a synthetic regression
task. It is the example of docs/runtime.md and what the runtime's own tests train."""
