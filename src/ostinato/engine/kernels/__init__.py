"""The engine's Triton kernels, each a leaf module that owns its constants, plus the
``KernelOptions`` that choose which run and the ``LaunchRules`` (``launch_rules``) that
say how they launch. Importing this package does not import Triton; a kernel module
does."""
