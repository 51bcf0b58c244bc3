"""The optional C parts: the CUDA backend's hot path (aiogpu/cuda/_hotc.c) and the virtual KFD of
the hsa-virtual backend (aiogpu/vkfd/vkfd.c, built as aiogpu/vkfd/libhsakmt.so.1); everything else
about the package is in pyproject.toml.

The extension is built where a C compiler and this Python's headers exist and skipped, with a
warning, where they do not: aiogpu then uses its pure-Python hot path (aiogpu.cuda.driver picks
the C one only when the module imports). It needs no CUDA headers or libraries to build.

The virtual KFD is a plain shared library (no Python module): the thunk ABI ``HSAKMT_1`` that
ROCr 5.2.3 links against, with soname ``libhsakmt.so.1``. It builds where a C compiler and
Debian's libhsakmt-dev headers (``hsakmt.h``) exist and is skipped, with a warning, elsewhere;
the hsa-virtual backend is then unavailable and says which packages it needs.
"""
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: ``optional=True`` covers compiler errors; this
    also covers a missing compiler or headers detected before compiling (setup errors)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any failure here means "no C hot path"
            self.warn(f"the optional C hot path (aiogpu.cuda._hotc) was not built: {exc}")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            what = "virtual KFD (hsa-virtual backend)" if ext.name == VKFD else f"C hot path ({ext.name})"
            self.warn(f"the optional {what} was not built: {exc}")

    def get_ext_filename(self, fullname: str) -> str:
        # the soname ROCr's DT_NEEDED names, not a Python module's name (distutils passes the
        # last component of the name when it builds outside the source tree)
        if fullname == VKFD:
            return os.path.join("aiogpu", "vkfd", "libhsakmt.so.1")
        if fullname == VKFD.rsplit(".", 1)[1] and VKFD in getattr(self, "ext_map", {}):
            return "libhsakmt.so.1"
        return super().get_ext_filename(fullname)

    def get_export_symbols(self, ext: Extension) -> list:
        return [] if ext.name == VKFD else super().get_export_symbols(ext)


VKFD = "aiogpu.vkfd.libhsakmt"


setup(
    ext_modules=[
        Extension("aiogpu.cuda._hotc", ["aiogpu/cuda/_hotc.c"], optional=True),
        Extension(VKFD, ["aiogpu/vkfd/vkfd.c"], optional=True, libraries=["pthread"],
                  depends=["aiogpu/vkfd/hsakmt.ver"],
                  extra_compile_args=["-fvisibility=hidden", "-Wall", "-Wno-unused-parameter"],
                  extra_link_args=["-Wl,--version-script=aiogpu/vkfd/hsakmt.ver", "-Wl,-soname,libhsakmt.so.1"]),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
