// RotaryQuant on CUDA: what the backend claims for our types (supports_op) and the dispatch behind
// the upstream hooks. The claims here must match what rq-iso.cu, rq-itq3.cu and fattn-iso.cu
// implement: every op that says yes runs on the GPU, every other one goes to the CPU backend.

#include "rq-impl.cuh"

// the CPU backend's vec_dot types (rotated query blocks, ITQ3_S activations): never on the GPU
static bool rq_is_cpu_internal(const ggml_type t) {
    return t == GGML_TYPE_ISOQ_Q || t == GGML_TYPE_ISOQ_Q64 || t == GGML_TYPE_Q8_ITQ;
}

static bool rq_is_ours(const ggml_type t) {
    return ggml_rq_type_is_iso(t) || t == GGML_TYPE_ITQ3_S || rq_is_cpu_internal(t);
}

static bool rq_is_float_out(const ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
}

// CPY/DUP/CONT from a to b
static bool rq_cpy_supported(const ggml_tensor * a, const ggml_tensor * b) {
    for (const ggml_tensor * t : { a, b }) {
        if (ggml_is_quantized(t->type) && t->nb[0] != ggml_type_size(t->type)) {
            return false; // blocks must be contiguous within a row (no transposed quantized views)
        }
    }
    if (a->type == b->type) {
        return ggml_rq_type_is_iso(a->type) || a->type == GGML_TYPE_ITQ3_S;    // memcpy or strided block copy
    }
    if (a->type == GGML_TYPE_F32 && ggml_rq_type_is_iso(b->type)) {
        return a->ne[0] % ggml_rq_iso_qk(b->type) == 0;                         // whole blocks in every source row
    }
    if (ggml_rq_type_is_iso(a->type) && (b->type == GGML_TYPE_F32 || b->type == GGML_TYPE_F16)) {
        return b->ne[0] % ggml_rq_iso_qk(a->type) == 0;                         // whole blocks in every destination row
    }
    return false;
}

int ggml_rq_cuda_supports_op(const ggml_tensor * op) {
    bool ours = rq_is_ours(op->type);
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        ours = ours || (op->src[i] && rq_is_ours(op->src[i]->type));
    }
    if (!ours) {
        return -1;
    }
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        if (op->src[i] && rq_is_cpu_internal(op->src[i]->type)) {
            return 0; // the CPU backend's internal vec_dot types
        }
    }

    const ggml_tensor * a = op->src[0];
    const ggml_tensor * b = op->src[1];

    switch (op->op) {
        case GGML_OP_MUL_MAT:
        case GGML_OP_MUL_MAT_ID:
            // ITQ3_S weights x F32 activations: MMVQ-style kernel at small batch, to_fp16 + cuBLAS beyond
            if (a->type != GGML_TYPE_ITQ3_S || b->type != GGML_TYPE_F32 || op->type != GGML_TYPE_F32) {
                return 0;
            }
            if (a->nb[0] != ggml_type_size(a->type) || b->nb[0] != sizeof(float) || a->ne[0] % QK_ITQ != 0) {
                return 0;
            }
            if (op->op == GGML_OP_MUL_MAT_ID && ggml_get_op_params_i32(op, 3) == GGML_PREC_F32) {
                return 0; // as upstream
            }
            return 1;
        case GGML_OP_GET_ROWS:
            return (ggml_rq_type_is_iso(a->type) || a->type == GGML_TYPE_ITQ3_S) && b->type == GGML_TYPE_I32 &&
                   rq_is_float_out(op->type) && a->nb[0] == ggml_type_size(a->type);
        case GGML_OP_SET_ROWS:
            return ggml_rq_type_is_iso(op->type) && a->type == GGML_TYPE_F32 && a->nb[0] == sizeof(float) &&
                   (b->type == GGML_TYPE_I64 || b->type == GGML_TYPE_I32) && a->ne[0] % ggml_rq_iso_qk(op->type) == 0;
        case GGML_OP_CPY:
            return rq_cpy_supported(a, b);
        case GGML_OP_DUP:
        case GGML_OP_CONT:
            return rq_cpy_supported(a, op);
        case GGML_OP_FLASH_ATTN_EXT:
            return -1; // fattn.cu asks ggml_rq_cuda_fattn_supported
        default:
            return -1; // generic handling upstream (views, concat of whole blocks, ...)
    }
}

// ---------------------------------------------------------------------------------------------
// dequantisers

template <typename T>
static to_t_cuda_t<T> rq_get_to_cuda(const ggml_type type) {
    switch (type) {
        case GGML_TYPE_ISOQUANT3_0:  return rq_iso_to_cuda<T, 3, QK_ISO>;
        case GGML_TYPE_ISOQUANT4_0:  return rq_iso_to_cuda<T, 4, QK_ISO>;
        case GGML_TYPE_ISOQUANT3_64: return rq_iso_to_cuda<T, 3, QK_ISO64>;
        case GGML_TYPE_ISOQUANT4_64: return rq_iso_to_cuda<T, 4, QK_ISO64>;
        case GGML_TYPE_ITQ3_S:       return rq_itq_to_cuda<T>;
        default:                    return nullptr;
    }
}

template <typename T>
static to_t_nc_cuda_t<T> rq_get_to_nc_cuda(const ggml_type type) {
    switch (type) {
        case GGML_TYPE_ISOQUANT3_0:  return rq_iso_to_nc_cuda<T, 3, QK_ISO>;
        case GGML_TYPE_ISOQUANT4_0:  return rq_iso_to_nc_cuda<T, 4, QK_ISO>;
        case GGML_TYPE_ISOQUANT3_64: return rq_iso_to_nc_cuda<T, 3, QK_ISO64>;
        case GGML_TYPE_ISOQUANT4_64: return rq_iso_to_nc_cuda<T, 4, QK_ISO64>;
        case GGML_TYPE_ITQ3_S:       return rq_itq_to_nc_cuda<T>;
        default:                    return nullptr;
    }
}

to_fp16_cuda_t    ggml_rq_get_to_fp16_cuda   (ggml_type type) { return rq_get_to_cuda<half>(type); }
to_fp32_cuda_t    ggml_rq_get_to_fp32_cuda   (ggml_type type) { return rq_get_to_cuda<float>(type); }
to_bf16_cuda_t    ggml_rq_get_to_bf16_cuda   (ggml_type type) { return rq_get_to_cuda<nv_bfloat16>(type); }
to_fp16_nc_cuda_t ggml_rq_get_to_fp16_nc_cuda(ggml_type type) { return rq_get_to_nc_cuda<half>(type); }
to_fp32_nc_cuda_t ggml_rq_get_to_fp32_nc_cuda(ggml_type type) { return rq_get_to_nc_cuda<float>(type); }
to_bf16_nc_cuda_t ggml_rq_get_to_bf16_nc_cuda(ggml_type type) { return rq_get_to_nc_cuda<nv_bfloat16>(type); }

// ---------------------------------------------------------------------------------------------
// SET_ROWS, CPY, GET_ROWS

bool ggml_rq_cuda_set_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (!ggml_rq_type_is_iso(dst->type)) {
        return false;
    }
    rq_iso_set_rows(ctx, dst);
    return true;
}

// same-type copy between non-contiguous tensors: whole blocks, flattened block order
static __global__ void k_rq_cpy_blocks(const char * __restrict__ cx, char * __restrict__ cdst, const int64_t nblocks, const int bs,
        const int64_t nb_0, const int64_t ne01, const int64_t ne02, const int64_t nb00, const int64_t nb01, const int64_t nb02, const int64_t nb03,
        const int64_t nb_1, const int64_t ne11, const int64_t ne12, const int64_t nb10, const int64_t nb11, const int64_t nb12, const int64_t nb13) {
    const int64_t i = rq_warp_id(); // one warp per block
    if (i >= nblocks) {
        return;
    }
    const auto [i00, i01, i02, i03] = rq_unravel(i, nb_0, ne01, ne02);
    const auto [i10, i11, i12, i13] = rq_unravel(i, nb_1, ne11, ne12);

    const char * x = cx   + i00*nb00 + i01*nb01 + i02*nb02 + i03*nb03;
    char       * y = cdst + i10*nb10 + i11*nb11 + i12*nb12 + i13*nb13;
    for (int k = threadIdx.x; k < bs; k += WARP_SIZE) {
        y[k] = x[k];
    }
}

bool ggml_rq_cuda_cpy(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, ggml_tensor * src1) {
    if (!rq_is_ours(src0->type) && !rq_is_ours(src1->type)) {
        return false;
    }
    if (src0->type == src1->type) {
        if (ggml_is_contiguous(src0) && ggml_is_contiguous(src1)) {
            return false; // upstream's memcpy
        }
        GGML_ASSERT(ggml_nelements(src0) == ggml_nelements(src1));
        const int64_t blck = ggml_blck_size(src0->type);
        GGML_ASSERT(src0->ne[0] % blck == 0 && src1->ne[0] % blck == 0);
        const int64_t nblocks = ggml_nelements(src0) / blck;
        if (nblocks > 0) {
            k_rq_cpy_blocks<<<rq_warp_grid(nblocks), rq_warp_block(), 0, ctx.stream()>>>(
                (const char *) src0->data, (char *) src1->data, nblocks, (int) ggml_type_size(src0->type),
                src0->ne[0]/blck, src0->ne[1], src0->ne[2], src0->nb[0], src0->nb[1], src0->nb[2], src0->nb[3],
                src1->ne[0]/blck, src1->ne[1], src1->ne[2], src1->nb[0], src1->nb[1], src1->nb[2], src1->nb[3]);
        }
        return true;
    }
    rq_iso_cpy(ctx, src0, src1);
    return true;
}

bool ggml_rq_cuda_get_rows(
        const void * src0_d, ggml_type src0_type, const int32_t * src1_d, void * dst_d, ggml_type dst_type,
        int64_t ne00, size_t nb01, size_t nb02, size_t nb03,
        int64_t ne10, int64_t ne11, int64_t ne12, size_t nb10, size_t nb11, size_t nb12,
        size_t nb1, size_t nb2, size_t nb3,
        cudaStream_t stream) {
    switch (src0_type) {
        case GGML_TYPE_ISOQUANT3_0:
        case GGML_TYPE_ISOQUANT4_0:
        case GGML_TYPE_ISOQUANT3_64:
        case GGML_TYPE_ISOQUANT4_64:
            rq_iso_get_rows(src0_d, src0_type, src1_d, dst_d, dst_type, ne00, nb01, nb02, nb03, ne10, ne11, ne12, nb10, nb11, nb12, nb1, nb2, nb3, stream);
            break;
        case GGML_TYPE_ITQ3_S:
            rq_itq_get_rows(src0_d, src1_d, dst_d, dst_type, ne00, nb01, nb02, nb03, ne10, ne11, ne12, nb10, nb11, nb12, nb1, nb2, nb3, stream);
            break;
        default:
            return false;
    }
    return true;
}
