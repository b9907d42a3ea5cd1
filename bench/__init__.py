"""Benchmarks: the engine-level runner (engine_bench), the peer (transformers) runner."""
