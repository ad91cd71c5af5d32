"""Build the optional C extensions boltzlabs.worker._fastpath (native/fastpath.c) and boltzlabs._wire
(native/wire.c).

Everything else is declared in pyproject.toml. A machine without a C compiler
or Python's headers still installs boltzlabs: the build of the extension is
skipped with a note, and the worker runs its pure-Python step path (it warns
once when it is imported; `bash ci/setup.sh` installs gcc and the headers).
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: the extension is an accelerator."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler at all (DistutilsPlatformError and kin)
            self._skipped(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # a compiler without Python.h, a compile error
            self._skipped(exc)

    def _skipped(self, exc):
        print(
            f"boltzlabs: could not build the native step path boltzlabs.worker._fastpath ({exc}); installing without it "
            "(the pure-Python path runs). Install gcc and the Python headers (bash ci/setup.sh) and reinstall."
        )


setup(
    ext_modules=[
        Extension(
            "boltzlabs.worker._fastpath",
            ["native/fastpath.c"],
            depends=["native/arrays.h"],
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        ),
        # The wire's encoder and ext hook (boltzlabs/wire.py uses it when it is there): every process
        # of a pool imports it, envs included; it imports only msgpack (numpy on the first array).
        Extension(
            "boltzlabs._wire",
            ["native/wire.c"],
            depends=["native/arrays.h"],
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
