"""Engine integrations: glue between an inference engine's KV cache and kvtier.

Each engine gets its own subpackage (imported only by callers that use that
engine, so kvtier never depends on it). Both are thin shims over one
engine-neutral adapter, ``engine_kv.EngineKV``: it registers the engine's KV
tensors (CPU ones adopted into shared memory, CUDA ones registered
in place over CUDA IPC), fences and submits the copies, and reports their
completion; the shims only translate the engine's calls.
"""
