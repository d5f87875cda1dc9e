"""Benchmark tools: `pagedllm bench throughput|latency|serve|compare` and the peer helpers they use."""
