"""The one compiled part: kvtier/pool/_native.c (the prefix index's entries and key table).

``optional=True``: where no C compiler or Python headers are found the build goes on
without it and kvtier runs the same index in pure Python (kvtier/pool/entry.py picks;
``kvtier status`` names which one runs). Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier.pool._native", ["kvtier/pool/_native.c"], optional=True,
                             extra_compile_args=["-O2", "-std=c11"])])
