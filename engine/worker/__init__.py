"""A shard worker: the model slice, its KV cache and the sampler, running one Step at a time.

``model_worker`` turns a ``Step`` into a ``ForwardBatch`` (``forward_batch``), runs the model
over the TokenAttention cache (``kv_cache``), eagerly or through the decode CUDA graphs
(``cuda_graphs``), and queues the sampling; ``process`` is the shard process of the server
(joins the tensor-parallel group, answers the router's Steps over its pipe).
"""
