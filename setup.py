"""The one thing pyproject.toml cannot say without a warning: the optional C extension.

kvbroker._copyhash (csrc/copyhash.c) holds the host copy engine's inner loops. It is optional:
where it cannot be built (no C compiler, no Python headers) the install goes on and the engine
runs its Python loops instead (`kvbroker doctor` says which). Everything else is in
pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvbroker._copyhash", ["csrc/copyhash.c"], extra_compile_args=["-O3"],
                  optional=True),
    ],
)
