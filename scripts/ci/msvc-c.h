/* Forced into each of our C sources by the Windows CI job (scripts/ci/windows.sh): what MSVC's C compiler rejects
 * and mingw's gcc would accept. C11 atomics (_Atomic, <stdatomic.h>) and C11 threads are poisoned here; VLAs are
 * refused by -Werror=vla beside it. Use ggml's or our own portable helpers instead (rq-atomic.h). */
#pragma GCC poison _Atomic
#pragma GCC poison thrd_create thrd_join mtx_init mtx_lock cnd_wait call_once
