"""TileLang kernel builders for sparse_dsa_ops, one module per kernel family.

A builder is a pure function of a frozen geometry record and keyword-only tile parameters that
returns a TileLang program. Nothing here knows about torch.library, devices or tensors.
"""
