# Shared by the CI jobs in scripts/ci (sourced): configure and build the ggml-only
# CI project (scripts/ci/CMakeLists.txt) into a folder, then run our types' tests, optionally under a
# runner (qemu). Every step exits non-zero on failure.

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
LLAMA=$REPO/build/src/llama-cpp-python/vendor/llama.cpp
JOBS=${JOBS:-$(nproc)}
RQ_TYPES="isoquant3_0|isoquant4_0|isoquant3_64|isoquant4_64|itq3_s"
RQ_OPS="FLASH_ATTN_EXT GET_ROWS SET_ROWS CPY MUL_MAT MUL_MAT_ID"
T0=$(date +%s)

die() { echo "[$CI_NAME] error: $*" >&2; exit 1; }
log() { echo "[$CI_NAME] $*"; }

# the jobs' command line: [--build DIR] sets BUILD; -h/--help prints the job script's header comment
ci_args() {
    while [ $# -gt 0 ]; do
        case $1 in
            --build) BUILD=$2; shift 2 ;;
            -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
            *) die "unknown argument $1 (see --help)" ;;
        esac
    done
}

export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$REPO}   # hits across clones at other paths, as in rotaryquant.build
export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
export PATH=$PATH:$REPO/.venv/bin                 # cmake/ninja from pip when the system lacks them

# ci_apt_install WHAT PKG...: Debian packages a job needs (as root; the package lists refreshed only if the first
# try fails), WHAT named in the log
ci_apt_install() {
    local what=$1; shift
    [ "$(id -u)" = 0 ] || die "needs $* (apt-get install, as root)"
    log "installing $what (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" > /dev/null 2>&1 \
        || { apt-get update -q > /dev/null 2>&1 \
             && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" > /dev/null; } \
        || die "apt-get install $* failed"
}

ci_check_tree() {
    [ -e "$LLAMA/ggml/src/ggml-rq" ] || die "$LLAMA is not a patched tree; run 'make setup' first"
}

# ci_build BUILD_DIR CMAKE_ARGS...: configure when the arguments changed, then build the test targets
ci_build() {
    local bdir=$1; shift
    local args=(-DCMAKE_BUILD_TYPE=Release "$@")
    local gen=()
    command -v ninja >/dev/null && gen=(-G Ninja)
    if [ ! -f "$bdir/CMakeCache.txt" ] || [ "$(cat "$bdir/.rq-ci-args" 2>/dev/null)" != "${args[*]}" ]; then
        log "configuring $bdir"
        rm -rf "$bdir"
        mkdir -p "$bdir"
        cmake -S "$REPO/scripts/ci" -B "$bdir" "${gen[@]}" "${args[@]}" > "$bdir/configure.log" 2>&1 \
            || { tail -40 "$bdir/configure.log"; die "cmake configure failed (log: $bdir/configure.log)"; }
        echo "${args[*]}" > "$bdir/.rq-ci-args"
    fi
    local t=$(date +%s)
    cmake --build "$bdir" -j "$JOBS" --target $CI_TARGETS > "$bdir/build.log" 2>&1 \
        || { grep -E "error|Error" -A3 "$bdir/build.log" | head -60; die "build failed (log: $bdir/build.log)"; }
    log "built $CI_TARGETS in $(( $(date +%s) - t )) s"
}

# ci_compile_cmd BUILD_DIR SOURCE: the folder and compiler command of one translation unit (compile_commands.json)
ci_compile_cmd() {
    python3 - "$1/compile_commands.json" "$2" <<'PY'
import json, sys
for e in json.load(open(sys.argv[1])):
    if e["file"].endswith(sys.argv[2]):
        print(e["directory"]); print(e["command"]); break
else:
    sys.exit(f"{sys.argv[2]} not in {sys.argv[1]}")
PY
}

# ci_macros BUILD_DIR SOURCE: the predefined macros that translation unit is compiled with
ci_macros() {
    local out dir cmd
    out=$(ci_compile_cmd "$1" "$2") || die "no compile command for $2"
    dir=$(sed -n 1p <<< "$out"); cmd=$(sed -n 2p <<< "$out")
    cmd=$(sed -E 's/ -o [^ ]+/ /; s/ -c / /; s/ -MD -MT [^ ]+ -MF [^ ]+/ /' <<< "$cmd")
    (cd "$dir" && eval "$cmd -dM -E -o -") || die "could not preprocess $2"
}

# ci_tests BIN_DIR [RUNNER...]: our C tests, test-quantize-fns and test-backend-ops for our types (CI_EXE: the
# programs' file suffix, .exe for Windows)
ci_tests() {
    local bin=$1; shift
    local run=("$@") fails=0 total=0 out n
    for t in test-rq-attn test-rq-itq3; do
        if out=$("${run[@]}" "$bin/$t${CI_EXE:-}" 2>&1); then
            log "$t: ok"
        else
            echo "$out" | tail -30; log "$t: FAILED"; fails=$((fails + 1))
        fi
    done
    out=$("${run[@]}" "$bin/test-quantize-fns${CI_EXE:-}" -v 2>&1) || { echo "$out" | grep -iv ": *ok" | tail -30; log "test-quantize-fns: FAILED"; fails=$((fails + 1)); }
    n=$(grep -cE "^ *(isoquant3_0|isoquant4_0|isoquant3_64|isoquant4_64|itq3_s) .*: +ok" <<< "$out" || true)
    if [ "$n" -ne 15 ]; then  # 5 types x (quantisation error, reference error, dot product error)
        grep -E "isoquant|itq3" <<< "$out"; log "test-quantize-fns: $n of 15 checks of our types ok"; fails=$((fails + 1))
    else
        log "test-quantize-fns: our types' 15 checks ok"
    fi
    for op in $RQ_OPS; do
        out=$("${run[@]}" "$bin/test-backend-ops${CI_EXE:-}" test -b CPU -o "$op" -p "$RQ_TYPES" 2>&1) && rc=0 || rc=$?
        n=$(grep -c "OK" <<< "$out" || true)
        if [ $rc -ne 0 ] || grep -q "FAIL" <<< "$out" || ! grep -q "tests passed" <<< "$out"; then
            grep -E "FAIL|tests passed" <<< "$out" | tail -30; log "test-backend-ops $op: FAILED (rc $rc)"; fails=$((fails + 1))
        else
            log "test-backend-ops $op: $(grep -o '[0-9]*/[0-9]* tests passed' <<< "$out")"
            total=$((total + $(grep -o '[0-9]*/[0-9]* tests passed' <<< "$out" | cut -d/ -f1)))
        fi
    done
    log "test-backend-ops: $total cases passed"
    [ $fails -eq 0 ] || die "$fails test program(s) failed"
    log "all tests passed in $(( $(date +%s) - T0 )) s in all"
}
