"""The engine: everything between a validated request and generated tokens.

Model side: `model_config` (config.json -> ModelConfig), `models/` (one Llama-family
implementation and the architecture registry), `rope`, `ops` (the one place that picks
Triton kernels or their torch references), `kv_cache` (TokenAttention buffers and the
request->token table), `forward_batch`, `sampling` and `worker` (runs one Step).
Router side: `allocator` (token slots), `scheduler` (admission, Step building, stop
criteria). `generation.Engine` joins the two in one process: the batched generation API.
"""
