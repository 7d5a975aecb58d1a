"""Imported once by the fork server of test_sglang.py's rank processes, so that
every rank forks with SGLang already imported (an import of SGLang took 30-70 s
on a loaded 2-core machine; each spawned rank paid it again)."""

from tests.integrations.test_sglang import _import_sglang

_import_sglang()
