"""The ``coding.write_function`` and ``coding.bugfix`` families (family.py) and their problem material (problems.py).

The registry (`k3post.envs.families.registry.BUILTIN_MODULES`) imports ``family.py``, which registers them."""
