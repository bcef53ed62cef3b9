"""How a running service shows itself: a status file (`nebula health`, `nebula site status`),
Prometheus metrics and, for training, TensorBoard scalars. See docs/runtime.md, "Health and metrics"."""
