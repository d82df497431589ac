"""Integrations with other libraries, each an optional extra imported on use:
``cudagraphs.integrations.transformers`` (LLM decoding with captured decode steps)."""
