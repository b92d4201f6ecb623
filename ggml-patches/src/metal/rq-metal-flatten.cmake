# Writes OUT (ggml-metal's kernels/rq.metal): our kernel sources as one library source, the tables and our own headers
# inlined (upstream's embed step inlines only its common.h, dequantize.h, ... and ggml-metal-impl.h; common.h already
# includes metal_stdlib and ggml-metal-impl.h). Rewritten only when the text changes, so a re-configure rebuilds
# nothing. Script mode: cmake -DRQ_METAL_DIR=<this folder> -DOUT=<file> -P rq-metal-flatten.cmake (tests/metal).

include(${RQ_METAL_DIR}/rq-metal-tables.cmake)
rq_metal_table(${RQ_METAL_DIR}/../isoquant-tables.h rq_iso_tables)
rq_metal_table(${RQ_METAL_DIR}/../itq3-tables.h     rq_itq3_tables)

set(rq_text "// generated from ggml/src/ggml-rq/metal by rq-metal-flatten.cmake: edit those sources\n#include \"common.h\"\n")
string(APPEND rq_text "\n// ---- isoquant-tables.h\n${rq_iso_tables}\n// ---- itq3-tables.h\n${rq_itq3_tables}")
foreach (rq_f rq-iso.h rq-iso.metal rq-iso-fa.metal rq-itq3.metal)
    file(READ ${RQ_METAL_DIR}/${rq_f} rq_src)
    string(REGEX REPLACE "#include [<\"](metal_stdlib|ggml-metal-impl\\.h|rq-[a-z0-9-]+\\.h)[>\"][^\n]*\n" "" rq_src "${rq_src}")
    string(REPLACE "#pragma once\n" "" rq_src "${rq_src}")
    string(APPEND rq_text "\n// ---- ${rq_f}\n${rq_src}")
endforeach()
file(WRITE ${OUT}.tmp "${rq_text}")
file(COPY_FILE ${OUT}.tmp ${OUT} ONLY_IF_DIFFERENT)
file(REMOVE ${OUT}.tmp)
