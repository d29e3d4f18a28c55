"""Host time: per op call, per training step (the GPU path's Python with launches faked), the model's own
Python, a profiler trace of the step, and the command line's start-up."""
