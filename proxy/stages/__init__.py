"""The pipeline's stages, one module each (``proxy/pipeline.py`` calls them in order)."""
