"""The engine: everything between a validated request and generated tokens.

Packages by role, in the order one request meets them:

| where | what it owns |
| --- | --- |
| ``protocol/`` | the messages every process exchanges (``messages``: GenerationRequest, Step, StepResult, TokenEvent, ...) and their one msgpack ``codec``; torch-free |
| ``client`` | the front end's end of the router pipe (``RouterClient``), or an in-process backend |
| ``router/`` | ``scheduler`` (Efficient Router admission, Step building, stop criteria) over ``allocator`` (KV token slots); ``router`` runs one pipelined step; ``process`` is the router process's loop |
| ``worker/`` | ``model_worker`` turns a Step into a ``forward_batch``, runs the model over the ``kv_cache`` (eager or ``cuda_graphs``) and queues the sampling; ``process`` is the shard process |
| ``models/`` | the registry (``architectures[0]`` -> family), shared config and rope, tensor-parallel layers, one file per family |
| ``ops`` | the one place that picks a Triton kernel (``kernels/``) or its torch reference |
| ``sampling/`` | the sampler (penalties, warpers, seeded draws), grammars, the watermark |
| ``assembly`` | the one composition path: ``EngineConfig`` -> ``EnginePlan`` -> a router over shards |
| ``generation`` | ``Engine``: the batched generation API in one process (no HTTP) |
| ``processes`` | spawning the shard and router processes (the launcher plans and supervises them) |

Nothing under ``engine/`` imports ``tgi_compat`` (TGI's flags, HTTP and the launcher's plan
live there and use the engine through ``assembly``, ``processes`` and ``client``).
"""
