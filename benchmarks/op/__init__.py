"""The op (``addnorm.ops.add_norm``) on its own: the op table against other implementations, on DTensors,
and the launch-configuration sweep."""
