"""Pallas (Mosaic GPU) kernels for MiniMax M3 and their pure-jnp references.

This package depends on jax only (never on m3jax or flax). Each op lives in its own sub-package with a
``reference.py`` (the specification, plain jnp) and, where a kernel exists, a Mosaic GPU kernel with the
same signature. Dimension letters used in docstrings:

  B batch, Sq query length, Sk key/cache length, Nq query heads, Nkv KV heads (= GQA groups), D head dim,
  Hi index heads (= Nkv), Di index head dim, T top-k blocks, nb key blocks, H hidden, E experts,
  K experts per token, I expert width.
"""
