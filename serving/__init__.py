"""FastAPI ranking server: lifespan-loaded model and KV cache, a batcher task, REST ranking, health, metrics."""
