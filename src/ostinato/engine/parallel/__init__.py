"""Engine worker processes and replicas for tensor and data parallelism."""
