"""The one native piece of ctxmem-kv: ``ctxmem_common.codecs._crc32c_native`` (CRC32C and a
fused copy + CRC32C in C; see the C file's header). Everything else is in pyproject.toml.

The extension is optional: if it cannot be built (no compiler, no Python headers, an old
Python), the install still succeeds and ``ctxmem_common.codecs`` falls back to the
``crc32c`` package (tests/shared/test_crc32c_paths.py fails then, rather than pass on the
fallback). ``CTXMEM_BUILD_NATIVE=0`` skips it on purpose (deploy/image/build.sh, for a
foreign architecture without a cross compiler; with one, it cross-compiles instead).
On Python >= 3.11 it is built against the limited API, so one wheel (cp311-abi3) per
architecture serves every later Python.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup

LIMITED = sys.version_info >= (3, 11) and not hasattr(sys, "gettotalrefcount")

ext_modules = []
if os.environ.get("CTXMEM_BUILD_NATIVE", "1") != "0":
    ext_modules.append(Extension(
        "ctxmem_common.codecs._crc32c_native",
        sources=["shared/ctxmem_common/codecs/_crc32c_native.c"],
        extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra"],
        define_macros=[("Py_LIMITED_API", "0x030B0000")] if LIMITED else [],
        py_limited_api=LIMITED,
        optional=True,
    ))

options = {"bdist_wheel": {"py_limited_api": "cp311"}} if LIMITED and ext_modules else {}
setup(ext_modules=ext_modules, options=options)
