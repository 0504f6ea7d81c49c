"""Render requests into the rank's tokens and vLLM's chained block hashes."""
