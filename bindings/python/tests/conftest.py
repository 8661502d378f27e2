"""Shared fixtures. SGLang's own code is imported without executing ``sglang/__init__.py``
(which pulls in the whole server): ``sglang`` is registered as a bare package whose
``__path__`` is the installed directory, and only the submodules the tests name are imported.
Without torch and sglang installed the SGLang tests are skipped, unless
``HICACHE_REQUIRE_SGLANG=1`` (CI), where that is a failure."""

import importlib.util
import os
import sys
import types

import pytest


def _register_bare_sglang():
    if "sglang" in sys.modules:
        return True
    spec = importlib.util.find_spec("sglang")
    if spec is None or importlib.util.find_spec("torch") is None:
        return False
    pkg = types.ModuleType("sglang")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["sglang"] = pkg
    return True


HAVE_SGLANG = _register_bare_sglang()


def require_sglang():
    """Skips the calling module without SGLang, or fails under HICACHE_REQUIRE_SGLANG=1."""
    if HAVE_SGLANG:
        return
    msg = "sglang and torch are not installed (bash bindings/python/setup-test-env.sh installs them)"
    if os.environ.get("HICACHE_REQUIRE_SGLANG") == "1":
        pytest.fail(msg + " and HICACHE_REQUIRE_SGLANG=1", pytrace=False)
    pytest.skip(msg, allow_module_level=True)
