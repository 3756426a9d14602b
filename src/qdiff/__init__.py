"""qdiff: why does the same GGUF model give different text on different devices?"""

__version__ = "0.1.0"
