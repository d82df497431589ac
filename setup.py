"""The one compiled piece: the host-side work before a replay (src/cudagraphs/core/_before_replay.cpp).

Optional: without a C++ compiler or the Python headers the install still succeeds and the guard
uses its fallbacks (see src/cudagraphs/core/guards.py). Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cudagraphs.core._before_replay",
            sources=["src/cudagraphs/core/_before_replay.cpp"],
            extra_compile_args=["-O2", "-std=c++17"],
            language="c++",
            optional=True,
        )
    ]
)
