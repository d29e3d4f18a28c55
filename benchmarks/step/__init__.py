"""Training steps: the LMs, the Hugging Face Llama (also under FSDP2), the encoder layer, tokens/s,
with the removable time (what fusion can take out of a step)."""
