"""Engine integrations: glue between an inference engine's KV cache and kvtier.

Each engine gets its own subpackage (imported only by callers that use that
engine, so kvtier never depends on it). Both move the engine-allocated CPU KV
tensor into memory the daemon can map with the one helper for that,
``kvtier.transfer.adopt.adopt_tensors`` (in place: same addresses).
"""
