"""What the processes say to each other: plain dataclass messages and their one msgpack codec.

``messages`` defines every message (a request and its sampling parameters, a Step and its
rows, results, token events, readiness and status); ``codec`` turns any of them into bytes
and back. Nothing here imports torch: the front end and the router build and read
messages without loading it.
"""
