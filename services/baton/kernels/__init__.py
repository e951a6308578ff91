"""baton's own compute kernels, below the model and the KV pool (both use them)."""
