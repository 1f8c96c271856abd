"""Make ``import torchvision`` (and any submodule) succeed where torchvision is not installed.

SGLang's storage and host pool modules import modules that import torchvision at the top
(image processors, model configs) without using it for KV storage; PyPI's torchvision does
not import beside the CPU torch. Importing this module installs, only when torchvision
cannot be found, a finder that serves stub modules: any name read from them is a class
that raises when instantiated, and ``InterpolationMode`` is a real enum (transformers builds
a table of its members at import). Only for the SGLang test processes and benchmarks: the
main pytest process never imports it (transformers would then believe torchvision is there).
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["InterpolationMode", "installed"]


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Unavailable:
    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError(f"{type(self).__qualname__}: torchvision is a stub in this process")


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_Unavailable,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stub"
        if spec.name.startswith("torchvision.transforms"):
            module.InterpolationMode = InterpolationMode
        return module

    def exec_module(self, module) -> None:
        pass


installed = importlib.util.find_spec("torchvision") is None
if installed:
    sys.meta_path.append(_Finder())
