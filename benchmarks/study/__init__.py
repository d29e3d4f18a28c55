"""The study and the documentation under load: ``addnorm study`` beside another process, the study's
memory estimate against real runs, and the documentation's torchrun blocks run many times."""
