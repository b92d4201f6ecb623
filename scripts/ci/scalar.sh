#!/usr/bin/env bash
# CI job: the scalar path. Builds the patched ggml for plain x86-64 (GGML_NATIVE=OFF, every x86 SIMD
# option off: what ggml's generic fallback runs on a CPU without AVX2) into build/scalar, with our
# C tests (no -mavx2), and runs test-rq-attn, test-rq-itq3, the fuzz harness (ASan/UBSan around the
# scalar kernels), test-quantize-fns and test-backend-ops restricted to our types. Checks first that
# our kernels really were compiled without AVX2 (predefined macros; no ymm register in the object).
#
#   scripts/ci/scalar.sh [--build DIR]     (default build/scalar; needs `make setup` done)
#
# ccache is used when installed (GGML_CCACHE); CCACHE_DISABLE=1 for a cold measurement.
set -euo pipefail
CI_NAME=scalar
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUILD=$REPO/build/scalar
ci_args "$@"
if [ "$(uname -m)" != x86_64 ]; then
    log "skipped: the scalar job is for x86-64 hosts (it builds x86-64 without SIMD)"; exit 0
fi
ci_check_tree

CI_TARGETS="test-backend-ops test-quantize-fns test-rq-attn test-rq-itq3 fuzz-rq"
ci_build "$BUILD" -DGGML_NATIVE=OFF -DGGML_SSE42=OFF -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_AVX_VNNI=OFF \
    -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF \
    -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DCMAKE_EXPORT_COMPILE_COMMANDS=ON

# the scalar kernels are the ones compiled: no AVX/SSE4 macro, and no 256-bit register in our objects
m=$(ci_macros "$BUILD" ggml-rq/cpu/arch/x86/rq-cpu-x86.c)
grep -qE "#define __(AVX|AVX2|FMA|F16C|SSSE3|SSE4_1)__ " <<< "$m" && die "rq-cpu-x86.c was compiled with x86 SIMD enabled"
objs=$(find "$BUILD" -path "*ggml-rq*" -name "*.o" -not -path "*fuzz*")
# isoquant.c, itq3.c; rq-cpu.c, rq-fa.c and the arch/ units (the Arm one and AVX-512 one compile to nothing here)
[ "$(wc -l <<< "$objs")" -eq 7 ] || die "expected 7 objects of ours, found: $objs"
for o in $objs; do
    n=$(objdump -d "$o" | grep -c "%ymm" || true)
    [ "$n" -eq 0 ] || die "$o uses ymm registers ($n instructions)"
done
log "our 7 objects: compiled without AVX/AVX2/FMA/F16C, no ymm instruction"

ci_tests "$BUILD/bin"
out=$("$BUILD/bin/fuzz-rq" -runs 4000 -seed 20261129 2>&1) || { echo "$out" | tail -30; die "fuzz-rq failed"; }
grep -q "no crash, NaN policy held" <<< "$out" || { echo "$out" | tail -10; die "fuzz-rq: no verdict"; }
log "fuzz-rq (ASan/UBSan, scalar kernels): ok; $(( $(date +%s) - T0 )) s in all"
