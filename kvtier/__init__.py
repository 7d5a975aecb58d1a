"""kvtier: a node-local shared CPU tier for LLM KV caches."""

__version__ = "0.1.0"
