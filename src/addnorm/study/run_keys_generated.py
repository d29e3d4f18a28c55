"""The run keys (key, default as YAML, meaning), generated from RunConfig by
addnorm.study.spec.write_run_keys(). Do not edit; a test checks that it matches the code."""

# ruff: noqa: E501
RUN_KEYS: tuple[tuple[str, str, str], ...] = (
    (
        "task",
        "lm",
        "lm (byte-level language modelling), copy, reverse or sort",
    ),
    (
        "corpus",
        "null",
        "text file or folder for lm (default: the Python standard library)",
    ),
    (
        "corpus_bytes",
        "4000000",
        "bytes of the corpus read for lm (at most; the rest is left)",
    ),
    (
        "symbols",
        "10",
        "alphabet size of the copy/reverse/sort tasks",
    ),
    (
        "steps",
        "200",
        "optimiser steps",
    ),
    (
        "batch_size",
        "16",
        "sequences per step",
    ),
    (
        "seq_len",
        "64",
        "tokens per sequence",
    ),
    (
        "lr",
        "0.001",
        "peak learning rate (AdamW, betas 0.9/0.98)",
    ),
    (
        "warmup",
        "0",
        "linear warmup steps (0: none); must be below steps",
    ),
    (
        "schedule",
        "constant",
        "learning-rate schedule after warmup: constant, linear_warmup, cosine, inverse_sqrt",
    ),
    (
        "grad_clip",
        "0.0",
        "clip the gradient norm at this value (0: no clipping)",
    ),
    (
        "weight_decay",
        "0.01",
        "AdamW weight decay on matrices and embeddings",
    ),
    (
        "seed",
        "0",
        "seeds the initialisation and the training batches",
    ),
    (
        "eval_every",
        "50",
        "held-out evaluation every this many steps (0: only at the end); <= steps",
    ),
    (
        "eval_batches",
        "4",
        "batches per held-out evaluation",
    ),
    (
        "probe_every",
        "0",
        "per-layer statistics every this many steps (0: first and last step only)",
    ),
    (
        "diverge_factor",
        "3.0",
        "a loss above this multiple of the first one ends the run as diverged",
    ),
    (
        "precision",
        "auto",
        "fp32; bf16 (autocast, on any device); auto: bf16 on a GPU that has it, else fp32",
    ),
    (
        "compile",
        "false",
        "torch.compile the model (probed steps run it uncompiled)",
    ),
    (
        "model",
        "addnorm",
        "the model: addnorm (addnorm's own transformer) or a Hugging Face family with random weights, re-placed by addnorm.hf.with_placement (lm task only): hf-llama, hf-mistral, hf-qwen2, hf-qwen3, hf-gemma2, hf-gemma3, hf-gpt2",
    ),
    (
        "kv_heads",
        "0",
        "hf- models: key/value heads (grouped-query attention); 0: n_heads",
    ),
    (
        "rope_theta",
        "10000.0",
        "hf- models: the RoPE base",
    ),
    (
        "fused",
        "false",
        "hf- models: run each residual connection in addnorm's fused op",
    ),
    (
        "hf_init",
        "own",
        "hf- models: the initialisation before the placement's own: own (the family's, normal 0.02 on every matrix and embedding) or xavier (Xavier-uniform layers, unit-variance embeddings, torch.nn.Linear's head: as addnorm's transformer starts)",
    ),
    (
        "distributed",
        "null",
        "train on N processes launched by torchrun, each on its shard of every batch: {strategy: ddp | fsdp2, nproc: N} (one process per GPU; gloo on the CPU); none: one process",
    ),
    (
        "d_model",
        "64",
        "width of the residual stream (hidden size)",
    ),
    (
        "n_heads",
        "4",
        "attention heads; must divide d_model",
    ),
    (
        "d_ff",
        "256",
        "hidden width of the feed-forward sublayer",
    ),
    (
        "n_layers",
        "4",
        "layers per stack",
    ),
    (
        "dropout",
        "0.0",
        "dropout rate on each sublayer's branch (0 turns dropout off)",
    ),
    (
        "attention_dropout",
        "null",
        "dropout on attention weights (default: dropout)",
    ),
    (
        "activation_dropout",
        "null",
        "dropout inside the FFN (default: dropout)",
    ),
    (
        "activation",
        "relu",
        "FFN activation: relu, gelu, swiglu",
    ),
    (
        "placement",
        "pre",
        "where the norm goes (see `addnorm list`), or a per-layer list of names",
    ),
    (
        "norm",
        "layernorm",
        "the norm (see `addnorm list`)",
    ),
    (
        "norm_eps",
        "1.0e-05",
        "epsilon of every norm",
    ),
    (
        "bias",
        "true",
        "bias in every Linear and norm",
    ),
    (
        "norm_bias",
        "null",
        "bias in the norms alone (default: bias)",
    ),
    (
        "final_norm",
        "auto",
        "norm after the last layer: auto (when the stream needs it), true, false",
    ),
    (
        "init",
        "xavier",
        "weight initialisation: torch, xavier, gpt2",
    ),
    (
        "n_encoder_layers",
        "null",
        "encoder layers of an encoder-decoder (default: n_layers)",
    ),
    (
        "n_decoder_layers",
        "null",
        "decoder layers of an encoder-decoder (default: n_layers)",
    ),
    (
        "positional",
        "sinusoidal",
        "positional encoding: sinusoidal, learned, none",
    ),
    (
        "residual",
        "true",
        "false removes every residual add (the ablation)",
    ),
    (
        "dropout_at",
        "branch",
        "where dropout acts: branch, after_add",
    ),
    (
        "norm_options",
        "{}",
        "the norm's own options, e.g. {zero_centered: true}",
    ),
    (
        "qk_norm",
        "false",
        "normalise queries and keys per head (Dehghani et al. 2023)",
    ),
    (
        "mix_fraction",
        "null",
        "for placement mix: fraction of Post-LN layers (default 0.25)",
    ),
)
