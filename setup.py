"""The one thing pyproject.toml cannot say without a warning: the optional C extensions.

kvbroker._copyhash (csrc/copyhash.c) holds the host copy engine's inner loops;
kvbroker._prefixscan (csrc/prefixscan.c) the daemon's per-block passes of a prefix match. Both
are optional: where they cannot be built (no C compiler, no Python headers) the install goes
on and their Python twins run instead, slower (`kvbroker doctor` says which). Everything else
is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvbroker._copyhash", ["csrc/copyhash.c"], extra_compile_args=["-O3"], optional=True
        ),
        Extension(
            "kvbroker._prefixscan", ["csrc/prefixscan.c"], extra_compile_args=["-O3"], optional=True
        ),
    ],
)
