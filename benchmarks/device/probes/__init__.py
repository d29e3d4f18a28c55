"""One-off device probes (issue 38), each run as a module on a GPU:
``python -m benchmarks.device.probes.hf_step_gc``."""
