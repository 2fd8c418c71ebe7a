"""The ops under other libraries' models: :mod:`.transformers` for Hugging Face transformers' DSA models."""

__all__: list[str] = []
