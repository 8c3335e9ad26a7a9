"""OpenAI-compatible serving: the async engine, the FastAPI app, Prometheus metrics."""
