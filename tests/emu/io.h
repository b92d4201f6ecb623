// File input and output of the GPU emulations' runners (tests/metal/run_kernels.cpp, tests/cuda/run_cuda.cpp):
// raw arrays, read whole; a failure exits with 2 and a message.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <vector>

inline std::vector<unsigned char> read_all(const char * path) {
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

// writes n bytes at data to path; 0, or 2 with a message
inline int write_bytes(const char * path, const void * data, size_t n) {
    FILE * f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n) {
        fprintf(stderr, "cannot write %s\n", path);
        if (f) {
            fclose(f);
        }
        return 2;
    }
    fclose(f);
    return 0;
}

template <typename T>
inline int write_all(const char * path, const std::vector<T> & v) {
    return write_bytes(path, v.data(), v.size()*sizeof(T));
}
