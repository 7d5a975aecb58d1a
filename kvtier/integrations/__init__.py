"""Engine integrations: glue between an inference engine's KV cache and kvtier.

Each engine gets its own subpackage (imported only by callers that use that
engine, so kvtier never depends on it); ``shared_memory`` is the one place that
moves an engine-allocated CPU tensor into memory the daemon can map.
"""
