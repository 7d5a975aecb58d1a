"""The one compiled part: kvtier/pool/_native.c (the prefix index's entries and key table).

``optional=True``: where no C compiler or Python headers are found the build goes on
without it and kvtier runs the same index in pure Python (kvtier/pool/entry.py picks;
``kvtier status`` names which one runs). ``KVTIER_BUILD_NATIVE=0`` skips it on purpose
(scripts/test.sh: venvs of the same Python share the one an editable install put in the
tree, which a second build would overwrite under running tests). Everything else is in
pyproject.toml.
"""

import os

from setuptools import Extension, setup

native = [Extension("kvtier.pool._native", ["kvtier/pool/_native.c"], optional=True,
                    extra_compile_args=["-O2", "-std=c11"])]
setup(ext_modules=native if os.environ.get("KVTIER_BUILD_NATIVE", "1") != "0" else [])
