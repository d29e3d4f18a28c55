"""addnorm's benchmarks, one subpackage per purpose, each benchmark a module run from the repository root
(``python -m benchmarks.step.lm_step ...``; ``benchmarks/README.md`` lists them all): ``op`` (the op
against other implementations), ``step`` (training steps), ``host`` (host time per call and per step),
``kernels`` (the Triton kernels compiled), ``device`` (the GPU suite and one-off device probes),
``study`` (the study's cost and the documentation's torchrun blocks), and ``common`` (timing, the
machine line, where results go). Recorded results: ``benchmarks/results/<device>/<date>-<commit>/``."""
