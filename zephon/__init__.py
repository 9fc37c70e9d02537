"""zephon: deterministic, elastic LLM data loading."""
