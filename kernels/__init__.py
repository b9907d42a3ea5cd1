"""Triton kernels of the engine, one operation per file.

Each module holds the ``@triton.jit`` kernel(s) of one operation (RMSNorm, rotary
embedding, KV copy into the TokenAttention buffer, ragged prefill attention,
split-K decode attention, SiLU-and-multiply, sampling penalties), a launcher that
checks shapes, dtypes, devices and strides before it launches, and a ``*_ref`` pure
torch function with the same signature and semantics that serves as the CPU path
and as the test oracle. Kernels load and store in the tensor's dtype (fp16, bf16,
fp32) and compute in float32. The package holds no state; ``engine/ops.py`` picks
between launchers and references.
"""
