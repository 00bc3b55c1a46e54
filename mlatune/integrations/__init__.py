"""Serving-engine plugins: ``core`` is the engine-agnostic adapter (``ServedModel``,
``refusal``, ``MLADecoder``); ``vllm`` and ``sglang`` are the backends built on it, each
importing its engine only when used. Nothing is imported here: ``import mlatune`` never
loads an engine."""
