"""kvoffload: a tiered KV-cache offload service for LLM inference."""

__version__ = "0.1.0"
