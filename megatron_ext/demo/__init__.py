"""The CPU demo of the UltraLong pipeline (`make demo`, `python -m megatron_ext.demo`)."""
