"""Shared by every benchmark: timing (interleaved rounds, paired ratios), the machine and commit a result
names, where results are written, and the backward-variant plans."""
