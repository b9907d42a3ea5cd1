"""Triton kernels of the engine, one operation per file.

Each module holds the ``@triton.jit`` kernel(s) of one operation (RMSNorm, rotary
embedding fused with the K/V store into the TokenAttention buffer, ragged prefill attention,
split-K decode attention, SiLU-and-multiply, the skinny GEMM of small decode batches,
sampling penalties), a launcher that checks shapes, dtypes, devices and strides before it
launches, and a ``*_ref`` pure torch function with the same signature and semantics that
serves as the CPU path and as the test oracle. Kernels load and store in the tensor's
dtype (fp16, bf16, fp32) and compute in float32. On Hopper the forward pass's kernels
launch with programmatic dependent launch (``_pdl.py``). The package holds no state;
``engine/ops.py`` picks between launchers and references.
"""
