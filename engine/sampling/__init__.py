"""Choosing the next token: the sampler and what shapes its distribution.

``sampler`` applies grammar masks, the watermark, penalties and the warpers to a step's
logits and draws (seeded, without host syncs); ``grammar`` compiles JSON-schema and regex
grammars to token masks (llguidance); ``watermark`` biases and detects Kirchenbauer green
lists; ``hashing`` is the counter hash both draw their randomness from. Runs on rank 0.
"""
