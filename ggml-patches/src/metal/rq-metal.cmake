# RotaryQuant Metal kernels, added to ggml-metal with -DGGML_RQ_METAL=ON (default OFF: the kernels have run only under
# tests/metal's emulation; Apple's compiler has never seen them, and a library that fails to compile would take the
# whole Metal backend down; scripts/metal/mac-check.sh turns it on). Included by ggml/src/ggml-metal/CMakeLists.txt
# (patch 0013) after METALLIB_KERNEL_SOURCES is set: our sources become one more per-kind library, kernels/rq.metal
# (GGML_METAL_LIBS_RQ in ggml-metal-device.m), and rq-metal.cpp gives supports_op and the encoding.

option(GGML_RQ_METAL "RotaryQuant kernels (IsoQuant, ITQ3_S) on Metal (experimental: never run on a Mac yet)" OFF)

if (GGML_RQ_METAL)
    set(RQ_METAL_DIR ${CMAKE_CURRENT_LIST_DIR})

    set(OUT ${CMAKE_CURRENT_SOURCE_DIR}/kernels/rq.metal)
    include(${RQ_METAL_DIR}/rq-metal-flatten.cmake)
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
        ${RQ_METAL_DIR}/../isoquant-tables.h ${RQ_METAL_DIR}/../itq3-tables.h ${RQ_METAL_DIR}/rq-iso.h
        ${RQ_METAL_DIR}/rq-iso.metal ${RQ_METAL_DIR}/rq-iso-fa.metal ${RQ_METAL_DIR}/rq-itq3.metal)
    list(APPEND METALLIB_KERNEL_SOURCES kernels/rq.metal)

    target_sources(ggml-metal PRIVATE ${RQ_METAL_DIR}/rq-metal.h ${RQ_METAL_DIR}/rq-metal.cpp)
    target_include_directories(ggml-metal PRIVATE ${RQ_METAL_DIR})
    target_compile_definitions(ggml-metal PRIVATE GGML_RQ_METAL)
endif()
