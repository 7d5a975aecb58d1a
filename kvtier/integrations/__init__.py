"""Engine integrations: code that runs inside an inference engine's processes.

Each engine lives in its own subpackage and imports the engine only there,
so ``import kvtier`` never needs vLLM or transformers installed.
"""
