#!/usr/bin/env bash
# CI job: Windows. Cross-compiles the patched ggml for x86-64 Windows with Debian's mingw-w64 (posix threads, static,
# the x86-64-v3 flags of the main build: AVX2, FMA, F16C; the AVX-512 kernels are taken at run time as on Linux)
# into build/windows, our C sources with what MSVC's C compiler rejects refused (-Werror=vla, C11 atomics and
# threads poisoned: scripts/ci/msvc-c.h), and runs under wine64 test-rq-attn, test-rq-itq3, test-quantize-fns
# and test-backend-ops restricted to our types. What it does not show: MSVC itself (its C++ and intrinsics
# headers), nor Windows' own loader and threads (wine's stand in).
#
#   scripts/ci/windows.sh [--build DIR]    (default build/windows; needs `make setup` done)
#
# Installs gcc-mingw-w64-x86-64-posix, g++-mingw-w64-x86-64-posix and wine64 with apt-get when missing (root).
set -euo pipefail
CI_NAME=windows
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUILD=$REPO/build/windows
ci_args "$@"
if [ "$(uname -m)" != x86_64 ]; then
    log "skipped: the job cross-compiles from an x86-64 host"; exit 0
fi
ci_check_tree

WINE=$(command -v wine64 || echo /usr/lib/wine/wine64)   # Debian's wine64 package has no /usr/bin entry
if ! command -v x86_64-w64-mingw32-g++-posix >/dev/null || [ ! -x "$WINE" ]; then
    ci_apt_install "mingw-w64 and wine64" gcc-mingw-w64-x86-64-posix g++-mingw-w64-x86-64-posix wine64
fi

CI_TARGETS="test-backend-ops test-quantize-fns test-rq-attn test-rq-itq3"
# Debian 12's mingw-w64 headers (v10) lack THREAD_POWER_THROTTLING_STATE, which upstream's ggml-cpu.c uses from the
# Windows 8 API level on (a hint that keeps Windows 11 from parking threads' cores); Windows 7's level skips just that
WINVER=-D_WIN32_WINNT=0x0601
ci_build "$BUILD" -DCMAKE_TOOLCHAIN_FILE="$REPO/scripts/ci/x86_64-w64-mingw32.cmake" -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_OPENMP=OFF -DRQ_FUZZ=OFF \
    -DRQ_MSVC_C_CHECKS=ON -DCMAKE_C_FLAGS=$WINVER -DCMAKE_CXX_FLAGS=$WINVER -DCMAKE_EXPORT_COMPILE_COMMANDS=ON

# the checks were on for our sources, and the programs are Windows ones
grep -q "msvc-c.h" <<< "$(ci_compile_cmd "$BUILD" ggml-rq/cpu/rq-fa.c)" || die "our sources were built without the MSVC C checks"
file "$BUILD/bin/test-rq-attn.exe" | grep -q "PE32+ executable" || die "test-rq-attn.exe is not a Windows x86-64 program"
log "our C sources: built for Windows with -Werror=vla and C11 atomics/threads refused"

export WINEPREFIX=$BUILD/wine WINEDEBUG=-all WINEDLLOVERRIDES="mscoree,mshtml="
CI_EXE=.exe ci_tests "$BUILD/bin" "$WINE"
"$(dirname "$WINE")/wineserver" -k 2>/dev/null || true
