"""Set-up (rq-setup, ``python3 -m rotaryquant.build``): fetch the pinned llama.cpp, apply
ggml-patches/, build it, wire Python to it. Stdlib only; runs before the venv exists.

One module per concern, in the order ``setup`` runs them:

- ``tools``: git, compilers, ccache, CMake
- ``venv``: the virtual environment and pip
- ``sdist``: the lock, the pinned sdist (download, checksum, unpack to ``pristine``)
- ``tree``: the unpacked tree's state stamp and our source links
- ``patches``: ggml-patches/*.patch applied (git am) and exported (git format-patch)
- ``ui``: llama-server's web UI built with npm into the cache, linked in as ``tools/ui/dist``
- ``cmake``: configure and build (targets, CPU flags, CUDA extras)
- ``install``: gguf-py, llama-cpp-python, rotaryquant into the venv; llama_cpp/lib -> our build
- ``common``: the error, log, subprocess/git runners and JSON stamps they all use
- ``cli``: the argparse layer (``main``)
"""
