// Our kernels' portable twins renamed to the kernels themselves where no arch/ file defines them: the same
// arch classes, in the same order, as ggml-cpu's arch-fallback.h. arch/x86 and arch/arm define every kernel
// they list (calling the twin where the build lacks the SIMD level), so the choice never depends on flags.
#pragma once

#if defined(GGML_CPU_GENERIC)
#define RQ_ARCH_NONE
#elif defined(__aarch64__) || defined(__arm__) || defined(_M_ARM) || defined(_M_ARM64) || defined(_M_ARM64EC)
#define RQ_ARCH_ARM
#elif defined(__x86_64__) || defined(__i386__) || defined(_M_IX86) || defined(_M_X64)
#define RQ_ARCH_X86
#else
#define RQ_ARCH_NONE
#endif

#if !defined(RQ_ARCH_ARM)
// arch/arm: NEON unpacked-row helpers (the x86 attention reads packed rows in place)
#define ggml_rq_iso_unpack_generic       ggml_rq_iso_unpack
#define ggml_rq_iso_dot_unpacked_generic ggml_rq_iso_dot_unpacked
#define ggml_rq_iso_mad_unpacked_generic ggml_rq_iso_mad_unpacked
#endif

#if !defined(RQ_ARCH_X86)
// arch/x86: the attention kernels (AVX2, AVX-512), the ITQ3_S activation rotation and tile codes
#define ggml_rq_fa_kernels_init_generic  ggml_rq_fa_kernels_init
#define quantize_row_q8_itq_generic      quantize_row_q8_itq
#define ggml_rq_itq3_codes_generic       ggml_rq_itq3_codes
#endif

#if defined(RQ_ARCH_NONE)
#define ggml_vec_dot_isoquant3_0_isoq_q_generic    ggml_vec_dot_isoquant3_0_isoq_q
#define ggml_vec_dot_isoquant4_0_isoq_q_generic    ggml_vec_dot_isoquant4_0_isoq_q
#define ggml_vec_dot_isoquant3_64_isoq_q64_generic ggml_vec_dot_isoquant3_64_isoq_q64
#define ggml_vec_dot_isoquant4_64_isoq_q64_generic ggml_vec_dot_isoquant4_64_isoq_q64
#define ggml_vec_dot_itq3_s_q8_itq_generic         ggml_vec_dot_itq3_s_q8_itq
#endif
