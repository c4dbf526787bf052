"""The ``coding.kernel`` family (family.py) and the operations it optimises (ops.py).

The registry (`k3post.envs.families.registry.BUILTIN_MODULES`) imports ``family.py``, which registers them."""
