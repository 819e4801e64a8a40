"""specprefetch: predict and prefetch MoE experts from flash into a bounded DRAM pool."""
__version__ = "0.1.0"
