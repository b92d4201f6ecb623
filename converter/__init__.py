"""HF folder / GGUF -> GGUF with ITQ3_S and per-role mixed precision (docs/converter.md), and the K-cache
calibration (docs/k-center.md).

``rq-convert SOURCE OUT.gguf [--recipe rotaryquant|itq3|rotaryquant-itq3|f16|bf16|q8_0|f32]``;
``rq-calibrate MODEL.gguf [-o OUT.gguf]``.

Modules: ``convert`` (the entry point: ``convert(source, output, Options(...)) -> Result``; ``options`` holds
those two, ``calibrate_step`` its calibration step), ``cli``
(rq-convert's argparse layer, ``main()``), ``hf`` (input resolution, folder checks, llama.cpp's
``conversion/`` package driven with our hooks), ``gguf_source`` (GGUF input), ``writer`` (the streaming
GGUFWriter), ``recipes`` (role -> type, kurtosis promotion, overrides, the per-tensor plan), ``roles``,
``stats`` (kurtosis), ``qtypes`` (type names, fallbacks, quantisation), ``imatrix`` (llama-imatrix files),
``calibration`` (per-block input Gram matrices for ITQ3_S's LDLQ quantiser), ``kcenter`` (K centring
statistics; ``gguf_keys`` reads our keys back), ``kvalloc`` (per-layer KV types, rq-calibrate --kv-bits) and
``calibrate_cli`` (rq-calibrate), ``hf_folders`` (HF folders made locally: SmolLM2 rebuilt from its GGUF, a tiny
Qwen2-MoE; for the demo, the benchmark and rq-plan --verify), ``torchshim`` (numpy stand-in for torch), ``dtypes``
(the safetensors dtype table, bfloat16 <-> float32), ``errors`` (the converter's exception). Elsewhere:
the ITQ3_S numpy reference is ``rotaryquant.quants.itq3``, the conversion benchmark
``rotaryquant.eval.convertspeed``.
"""
