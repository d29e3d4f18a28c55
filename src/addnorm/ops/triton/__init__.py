"""The fused op's Triton side, each module one role (every one of them imports triton: import them lazily,
as :mod:`addnorm.ops.functional`, :mod:`addnorm.ops.library` and :mod:`addnorm.ops.sharded` do):

- :mod:`.tiles`: the ``@triton.jit`` tile helpers every kernel shares (each rule of the op written once);
- :mod:`.kernels`: the single-device forward and backward kernels;
- :mod:`.tp_kernels`: the tensor-parallel kernels (four passes over column shards);
- :mod:`.launchers`: the launch specs (grid, chunks, constexprs) and the launchers built from them;
- :mod:`.direct_launch`: launching a compiled variant without ``JITFunction.run``'s per-call work;
- :mod:`.eager`: the eager path's autograd function (no op dispatch);
- :mod:`.op_launchers`: the registered op's bodies' launchers (``wrap_triton`` where traced);
- :mod:`.tp_launchers`: the tensor-parallel launchers.

This package's ``__init__`` imports nothing."""
