# IsoQuant's and ITQ3_S's constant tables for Metal, made from the C headers (ggml-rq/isoquant-tables.h,
# itq3-tables.h: the single source): program-scope constants live in Metal's constant address space, as upstream's
# kvalues_iq4nl_f do. rq_metal_table(<C header> <var>) sets var to the Metal text; rq-metal-flatten.cmake inlines it
# into kernels/rq.metal. Script mode writes them as the headers the kernel sources include (tests/metal):
#   cmake -DOUT_DIR=<dir> -P rq-metal-tables.cmake   ->  <dir>/rq-iso-tables.h, <dir>/rq-itq3-tables.h

set(RQ_METAL_TABLES_SRC ${CMAKE_CURRENT_LIST_DIR}/..)

function(rq_metal_table src out)
    file(READ ${src} txt)
    string(FIND "${txt}" "#pragma once\n" at)
    string(SUBSTRING "${txt}" ${at} -1 txt)
    string(REPLACE "#pragma once\n" "" txt "${txt}")
    string(REPLACE "#include <stdint.h>\n" "" txt "${txt}")
    string(REGEX REPLACE "\nstatic const (float|int8_t) " "\nconstexpr constant static \\1 " txt "${txt}")
    set(${out} "${txt}" PARENT_SCOPE)
endfunction()

if (CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
    foreach (rq_pair "isoquant-tables.h;rq-iso-tables.h" "itq3-tables.h;rq-itq3-tables.h")
        list(GET rq_pair 0 rq_src)
        list(GET rq_pair 1 rq_dst)
        rq_metal_table(${RQ_METAL_TABLES_SRC}/${rq_src} rq_txt)
        file(WRITE ${OUT_DIR}/${rq_dst} "// made from ggml-rq/${rq_src} by rq-metal-tables.cmake\n#pragma once\n${rq_txt}")
    endforeach()
endif()
