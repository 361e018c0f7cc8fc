"""OpenAI-compatible server (`hyspec serve`): continuous batching over fixed slots, chunked prefill, SSE
streaming, Prometheus metrics. Standard library HTTP (asyncio streams); no web framework needed."""
