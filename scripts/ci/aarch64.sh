#!/usr/bin/env bash
# CI job: the NEON path. Cross-compiles the patched ggml for AArch64 (Debian's cross toolchain,
# -march=armv8.2-a+dotprod+fp16: the ARMv8.2 level of Apple M1, Graviton2 and phones since 2018)
# into build/aarch64 and runs, under qemu-aarch64, test-rq-attn, test-rq-itq3, test-quantize-fns and
# test-backend-ops restricted to our types. Checks first that our kernels were compiled with NEON
# (predefined macros; NEON table lookups in the object), and that they also compile for plain
# armv8-a (no sdot: ggml's widening-multiply fallback). Correctness only: emulation says nothing of speed.
#
#   scripts/ci/aarch64.sh [--build DIR]    (default build/aarch64; needs `make setup` done)
#
# Installs gcc-aarch64-linux-gnu, g++-aarch64-linux-gnu and qemu-user with apt-get when missing (root).
set -euo pipefail
CI_NAME=aarch64
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUILD=$REPO/build/aarch64
ARCH=armv8.2-a+dotprod+fp16
SYSROOT=/usr/aarch64-linux-gnu
ci_args "$@"
if [ "$(uname -m)" != x86_64 ]; then
    log "skipped: the job cross-compiles from an x86-64 host"; exit 0
fi
ci_check_tree

if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
    ci_apt_install "the aarch64 cross toolchain and qemu-user" gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user
fi

CI_TARGETS="test-backend-ops test-quantize-fns test-rq-attn test-rq-itq3"
ci_build "$BUILD" -DCMAKE_TOOLCHAIN_FILE="$REPO/scripts/ci/aarch64-linux-gnu.cmake" -DGGML_NATIVE=OFF \
    -DGGML_CPU_ARM_ARCH=$ARCH -DRQ_FUZZ=OFF -DCMAKE_EXPORT_COMPILE_COMMANDS=ON

# the NEON kernels are the ones compiled (RQ_NEON is set only under __ARM_NEON && __aarch64__)
SRC=ggml-rq/cpu/arch/arm/rq-cpu-arm.c
m=$(ci_macros "$BUILD" $SRC)
for f in __aarch64__ __ARM_NEON __ARM_FEATURE_DOTPROD __ARM_FEATURE_FP16_VECTOR_ARITHMETIC; do
    grep -q "#define $f " <<< "$m" || die "$SRC was compiled without $f"
done
o=$(find "$BUILD" -name "rq-cpu-arm.c.o" -not -path "*fuzz*" | head -1)
[ -n "$o" ] || die "no rq-cpu-arm.c object in $BUILD"
dis=$(aarch64-linux-gnu-objdump -d "$o")
n_tbl=$(grep -cE "\stbl\s" <<< "$dis" || true); n_dot=$(grep -cE "\ssdot\s" <<< "$dis" || true)
[ "$n_tbl" -gt 0 ] && [ "$n_dot" -gt 0 ] || die "rq-cpu-arm.c.o has no NEON lookups/dots (tbl $n_tbl, sdot $n_dot)"
log "rq-cpu-arm.c: compiled for $ARCH with NEON ($n_tbl tbl, $n_dot sdot instructions)"
# plain armv8-a (no dotprod, no fp16 arithmetic) must compile too: the same unit, another -march
out=$(ci_compile_cmd "$BUILD" $SRC)
cmd=$(sed -n 2p <<< "$out" | sed -E 's/ -o [^ ]+/ -o \/dev\/null/; s/ -MD -MT [^ ]+ -MF [^ ]+/ /')
cmd=${cmd//-march=$ARCH/-march=armv8-a}
grep -q -- "-march=armv8-a " <<< "$cmd" && ! grep -q dotprod <<< "$cmd" || die "could not make an armv8-a compile command"
(cd "$(sed -n 1p <<< "$out")" && eval "$cmd") || die "rq-cpu-arm.c does not compile for plain armv8-a"
log "rq-cpu-arm.c: compiles for plain armv8-a too"

ci_tests "$BUILD/bin" qemu-aarch64 -L "$SYSROOT"
