"""Empty stand-ins for modules SGLang's scheduler files import but the cache replays never
call (the OpenAI protocol and the reasoning parser, reached through ``schedule_batch``'s
grammar import). Every attribute of a stand-in module is one inert placeholder class, so
``from m import A, B`` and class bodies that subclass or annotate with them still load.
Installed before ``sglang_import.load()``; nothing installed by pip is touched.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _AnyMeta(type):
    """Placeholder class whose attributes, items and unions are itself."""

    def __getattr__(cls, name):
        return cls

    def __getitem__(cls, key):
        return cls

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls


class Placeholder(metaclass=_AnyMeta):
    def __init__(self, *args, **kwargs):
        pass

    def __init_subclass__(cls, **kwargs):
        pass


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = frozenset(roots)

    def find_spec(self, name, path, target=None):
        if any(name == r or name.startswith(r + ".") for r in self.roots):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install(roots):
    """Serve every module named in ``roots`` (and below) as an empty stand-in."""
    sys.meta_path.insert(0, _Finder(roots))
