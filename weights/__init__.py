"""Weights (among other modules of this package): reading safetensors checkpoints (whole tensors or one rank's slice) and
writing random checkpoints with a real model's exact config, tokenizer included.

- ``weights.checkpoint``: ``open_checkpoint``, ``Checkpoint``, ``read_config``, ``CheckpointError``
- ``weights.random_checkpoint``: ``REAL_CONFIGS``, ``write_random_checkpoint`` (+ CLI)
- ``weights.tokenizer_builder``: synthetic byte-level BPE tokenizers of an exact vocab size
"""
