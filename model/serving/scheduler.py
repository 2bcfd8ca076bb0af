"""The old home of MAX_SLOTS, kept only while model/tools/serve_bench.py imports it from here: the slots are the
padded memory's now (memory.MAX_SLOTS), the Serving page runs on engine.Engine. Delete once nothing imports it."""

from model.serving.memory import MAX_SLOTS

__all__ = ["MAX_SLOTS"]
