"""Any PyTorch model across sites from a job file: a model named by reference, cut at split points by torch's
own splitter, each stage holding its slice; loss, optimiser and data by configuration (docs/model.md)."""
