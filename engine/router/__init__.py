"""The router: which requests run, where their tokens live, and when they stop.

``allocator`` hands out KV token slots (reference-counted) and request rows (and checks its
own integrity); ``prefix_cache`` is the radix tree that keeps prompt prefixes' slots for reuse;
``scheduler`` admits waiting requests by the Efficient Router's peak-usage rule, builds each
``Step`` (prompt chunks and decode rows) and applies the stop criteria; ``router`` runs one
pipelined step against any ``Shards`` (an in-process worker, or worker processes); ``process``
is the router process of the server: the step loop between the front end's pipe and the
shards' pipes. Pure Python: no torch, no device.
"""
