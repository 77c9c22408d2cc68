"""What the engine decides on the host: requests, the scheduler, KV blocks, limits, and the
process's collector around a start."""
