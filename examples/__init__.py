"""Model code on the ``sparse_dsa_ops`` ops: ``dsa_layer`` is a whole DSA attention layer, run by the tests."""
