"""HF folder / GGUF -> GGUF with ITQ3_S and per-role mixed precision (issue 5; docs/converter.md).

``rq-convert SOURCE OUT.gguf [--recipe rotaryquant|itq3|rotaryquant-itq3|f16|bf16|q8_0|f32]``.

Modules: ``convert`` (the entry point: ``convert(source, output, Options(...)) -> Result``), ``cli``
(the argparse layer, ``main()``), ``hf`` (input resolution, folder checks, llama.cpp's ``conversion/``
package driven with our hooks), ``gguf_source`` (GGUF input), ``writer`` (the streaming GGUFWriter),
``recipes`` (role -> type, kurtosis promotion, overrides, the per-tensor plan), ``roles``, ``stats``,
``qtypes`` (type names, fallbacks, quantisation), ``imatrix``, ``torchshim`` (numpy stand-in for
torch), ``dtypes`` (the safetensors dtype table, bfloat16 <-> float32), ``bench``, and ``itq3``
(the ITQ3_S numpy quantiser). The HF folders that tests, the benchmark and ``make demo`` convert are
made by ``rotaryquant.fixtures``, outside this package.
"""
