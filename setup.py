"""The optional C hot path of the CUDA backend (aiogpu/cuda/_hotc.c); everything else about the
package is in pyproject.toml.

The extension is built where a C compiler and this Python's headers exist and skipped, with a
warning, where they do not: aiogpu then uses its pure-Python hot path (aiogpu.cuda.driver picks
the C one only when the module imports). It needs no CUDA headers or libraries to build.
"""
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
            self.warn(f"the optional C hot path ({ext.name}) was not built: {exc}")


setup(
    ext_modules=[Extension("aiogpu.cuda._hotc", ["aiogpu/cuda/_hotc.c"], optional=True)],
    cmdclass={"build_ext": OptionalBuildExt},
)
