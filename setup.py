"""The optional native copy-and-hash (csrc/): everything else is in pyproject.toml.

``optional=True``: where it cannot be compiled (no C compiler, no Python headers), the install
goes on without it and kvckpt copies and hashes with numpy and python-xxhash.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvckpt.engines._copy_hash",
            sources=[
                "csrc/copy_hash.c",
                "csrc/copy_hash_avx2.c",
                "csrc/copy_hash_generic.c",
            ],
            include_dirs=["vendor/xxhash", "csrc"],
            depends=[
                "csrc/copy_hash_flags.h",
                "csrc/copy_hash_kernel.h",
                "csrc/copy_stream.h",
                "vendor/xxhash/xxhash.h",
            ],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
