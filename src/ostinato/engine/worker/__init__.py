"""What runs a step on the device: the model runner, its persistent step inputs, memory
sizing, micro-batched steps and the start-up GEMM plans."""
