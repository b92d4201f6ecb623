// Runs our Metal kernels (ggml-patches/src/metal/*.metal, unchanged) on the CPU through the emulation in
// shim/metal_stdlib. Driven by tests/metal/test_metal.py, which makes the inputs with ggml's C reference and
// compares the outputs.
//
//   run_kernels get_rows TYPE N_ROWS NE00 ORDER IN OUT
//     IN: N_ROWS rows of TYPE blocks; rows are gathered in reverse order (ids N_ROWS-1 .. 0), so OUT row i is the
//     F32 dequantisation of IN row N_ROWS-1-i. ORDER: 0 runs each threadgroup's lanes forward, 1 in reverse.

#include "rq-iso.metal"

#include <string>

static std::vector<unsigned char> read_all(const char * path) {
    FILE * f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path);
        exit(2);
    }
    std::vector<unsigned char> buf;
    unsigned char tmp[65536];
    size_t n;
    while ((n = fread(tmp, 1, sizeof(tmp), f)) > 0) {
        buf.insert(buf.end(), tmp, tmp + n);
    }
    fclose(f);
    return buf;
}

template <typename block_q, short BITS, short QK>
static void get_rows(int n_rows, int ne00, int order, const std::vector<unsigned char> & src, std::vector<float> & out) {
    const size_t row_bytes = (size_t) (ne00/QK)*sizeof(block_q);
    if (src.size() != row_bytes*n_rows) {
        fprintf(stderr, "input has %zu bytes, expected %zu\n", src.size(), row_bytes*n_rows);
        exit(2);
    }
    std::vector<int32_t> ids(n_rows);
    for (int i = 0; i < n_rows; ++i) {
        ids[i] = n_rows - 1 - i;
    }
    out.assign((size_t) n_rows*ne00, 0.0f);

    ggml_metal_kargs_get_rows args = {};
    args.ne00t = ne00;
    args.ne00  = ne00;
    args.nb01  = row_bytes;
    args.nb02  = row_bytes*n_rows;
    args.nb03  = row_bytes*n_rows;
    args.ne10  = n_rows;
    args.nb10  = sizeof(int32_t);
    args.nb11  = sizeof(int32_t)*n_rows;
    args.nb12  = sizeof(int32_t)*n_rows;
    args.nb1   = sizeof(float)*ne00;
    args.nb2   = sizeof(float)*ne00*n_rows;
    args.nb3   = sizeof(float)*ne00*n_rows;

    std::vector<unsigned char> shmem;
    rq_mtl::dispatch((unsigned) n_rows, N_SIMDWIDTH, sizeof(block_q), shmem, [&](unsigned g, unsigned tid) {
        kernel_get_rows_iso<block_q, BITS, QK>(args, src.data(), ids.data(), out.data(), shmem.data(),
                                               metal::uint3(g, 0, 0), (metal::ushort) tid);
    }, order);
}

int main(int argc, char ** argv) {
    if (argc != 8 || std::string(argv[1]) != "get_rows") {
        fprintf(stderr, "usage: %s get_rows TYPE N_ROWS NE00 ORDER IN OUT\n", argv[0]);
        return 2;
    }
    const std::string type = argv[2];
    const int n_rows = atoi(argv[3]), ne00 = atoi(argv[4]), order = atoi(argv[5]);
    const std::vector<unsigned char> src = read_all(argv[6]);
    std::vector<float> out;
    if (type == "isoquant3_0") {
        get_rows<block_isoquant3_0, 3, QK_ISO>(n_rows, ne00, order, src, out);
    } else if (type == "isoquant4_0") {
        get_rows<block_isoquant4_0, 4, QK_ISO>(n_rows, ne00, order, src, out);
    } else if (type == "isoquant3_64") {
        get_rows<block_isoquant3_64, 3, QK_ISO64>(n_rows, ne00, order, src, out);
    } else if (type == "isoquant4_64") {
        get_rows<block_isoquant4_64, 4, QK_ISO64>(n_rows, ne00, order, src, out);
    } else {
        fprintf(stderr, "unknown type %s\n", type.c_str());
        return 2;
    }
    FILE * f = fopen(argv[7], "wb");
    if (!f || fwrite(out.data(), sizeof(float), out.size(), f) != out.size()) {
        fprintf(stderr, "cannot write %s\n", argv[7]);
        return 2;
    }
    fclose(f);
    return 0;
}
