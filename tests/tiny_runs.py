"""The sizes of the tests' tiny training runs (a 2-layer, 16-wide model on batches of 4 sequences of 16
tokens): a test module adds its own steps and evaluation schedule."""

TINY_SIZES = {"d_model": 16, "n_heads": 2, "d_ff": 32, "n_layers": 2, "batch_size": 4, "seq_len": 16}
