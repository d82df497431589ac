"""The one compiled piece: the address check behind the guard (src/cudagraphs/core/_addresses.cpp).

Optional: without a C++ compiler or the Python headers the install still succeeds and the guard
uses its pure fallbacks (see cudagraphs/core/addresses.py). Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cudagraphs.core._addresses",
            sources=["src/cudagraphs/core/_addresses.cpp"],
            extra_compile_args=["-O2", "-std=c++17"],
            language="c++",
            optional=True,
        )
    ]
)
