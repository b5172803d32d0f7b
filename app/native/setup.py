"""Builds the gpufeed_jpeg extension against the system's libjpeg-turbo (libjpeg-dev on Debian
and Ubuntu). Linked dynamically: Debian's and Ubuntu's libjpeg.a are not position-independent
(a shared object cannot take them), so the module needs libjpeg-turbo's runtime package where
it runs (libjpeg62-turbo on Debian 12, libjpeg-turbo8 on Ubuntu 24.04; the images install the
one that the builder linked against).
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "gpufeed_jpeg",
            ["src/module.cpp", "src/decode.cpp", "src/header.cpp", "src/resize.cpp"],
            include_dirs=["src"],
            libraries=["jpeg"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    ],
)
