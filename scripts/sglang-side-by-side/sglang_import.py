"""Imports SGLang's own cache modules without running ``sglang/__init__.py``.

``sglang/__init__.py`` imports the frontend language and its HTTP client (aiohttp and more),
which the cache modules do not use. The ``sglang`` and ``sglang.srt`` packages are created
empty with the installed package's directories as their search paths, so every module this
loads is the installed file, unchanged; ``sglang.srt.utils`` and everything the cache modules
import run as installed.
"""

import importlib.metadata
import importlib.util
import os
import sys
import types


def load():
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("sglang is not installed in this Python environment")
    root = spec.submodule_search_locations[0]
    for name, path in (("sglang", root), ("sglang.srt", os.path.join(root, "srt"))):
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = [path]
            sys.modules[name] = m
    return importlib.metadata.version("sglang")
