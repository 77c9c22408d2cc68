"""The engine's Triton kernels, each a leaf module that owns its constants, plus the
``KernelOptions`` that choose how they launch. Importing this package does not import
Triton; a kernel module does."""
