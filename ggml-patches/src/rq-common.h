// RotaryQuant block formats. Included by ggml-common.h inside its declaration section, so every
// backend (C, C++, CUDA) sees the same structs; ggml_half and static_assert come from there.

// ISOQUANT3_0: one 128-value head vector. d = ||x|| (fp16); qs = 3-bit Lloyd-Max indices of
// R(x/||x||), R = SO(4) blocks after WHT-128. Groups of 8 indices fill 3 bytes, little endian:
// index k of group g is bits 3k..3k+2 of qs[3g] | qs[3g+1] << 8 | qs[3g+2] << 16.
#define QK_ISO 128
typedef struct {
    ggml_half d;
    uint8_t   qs[QK_ISO*3/8];
} block_isoquant3_0;
static_assert(sizeof(block_isoquant3_0) == sizeof(ggml_half) + QK_ISO*3/8, "wrong isoquant3_0 block size/padding");

// ISOQUANT4_0: the same with 4-bit indices of a 16-level codebook. Groups of 8 indices fill 4 bytes by
// the same rule (index k of group g is bits 4k..4k+3 of the little-endian word qs[4g..4g+3]), i.e. two
// indices per byte, the even one in the low nibble.
typedef struct {
    ggml_half d;
    uint8_t   qs[QK_ISO*4/8];
} block_isoquant4_0;
static_assert(sizeof(block_isoquant4_0) == sizeof(ggml_half) + QK_ISO*4/8, "wrong isoquant4_0 block size/padding");

// ISOQUANT3_64 / ISOQUANT4_64: the same formats on 64-value blocks (head size 64): WHT-64 + 16 SO(4) blocks and
// the Lloyd-Max codebooks of a unit 64-vector's coordinate; 26 / 34 bytes per 64 values (3.25 / 4.25 bits).
#define QK_ISO64 64
typedef struct {
    ggml_half d;
    uint8_t   qs[QK_ISO64*3/8];
} block_isoquant3_64;
static_assert(sizeof(block_isoquant3_64) == sizeof(ggml_half) + QK_ISO64*3/8, "wrong isoquant3_64 block size/padding");

typedef struct {
    ggml_half d;
    uint8_t   qs[QK_ISO64*4/8];
} block_isoquant4_64;
static_assert(sizeof(block_isoquant4_64) == sizeof(ggml_half) + QK_ISO64*4/8, "wrong isoquant4_64 block size/padding");

// ISOQ_Q (internal): a query block already rotated by R, in F32; ISOQUANT3_0/4_0's vec_dot_type, so that
// flash attention and mul_mat rotate each query row once and score packed keys directly.
typedef struct {
    float qr[QK_ISO];
} block_isoq_q;
static_assert(sizeof(block_isoq_q) == QK_ISO*sizeof(float), "wrong isoq_q block size/padding");

// ISOQ_Q64 (internal): the same for the 64-wide rotation; vec_dot_type of ISOQUANT3_64/4_64.
typedef struct {
    float qr[QK_ISO64];
} block_isoq_q64;
static_assert(sizeof(block_isoq_q64) == QK_ISO64*sizeof(float), "wrong isoq_q64 block size/padding");

// ITQ3_S: 256 weights after signs and the normalised FWHT-256, as 3-bit codes on a shared 8-level
// grid: w_rot[i] = d * grid[q_i] + m. qs: low 2 bits of codes j, 64+j, 128+j, 192+j in qs[j];
// qh: bit b of qh[j] is the high bit of code 32b+j.
#define QK_ITQ 256
typedef struct {
    ggml_half d;
    ggml_half m;
    uint8_t   qs[QK_ITQ/4];
    uint8_t   qh[QK_ITQ/8];
} block_itq3_s;
static_assert(sizeof(block_itq3_s) == 2*sizeof(ggml_half) + QK_ITQ/4 + QK_ITQ/8, "wrong itq3_s block size/padding");

// Q8_ITQ (internal): ITQ3_S's vec_dot_type, an activation block after the same FWHT-256, in the
// block_q8_K layout (float d, int8 qs[256], int16 bsums[16]) with 7-bit codes, |qs| <= 63.
