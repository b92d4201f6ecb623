"""``rq-plan``: the best quality that fits a memory budget — weights recipe x KV-cache type, at the
context the user needs, predicted from llama.cpp's own memory accounting and our measured quality.

What a candidate costs (peak resident memory of ``llama-server`` on CPU, VmHWM after a request that
fills the context):

- weights: the model file's tensor data, memory-mapped; tensors that the CPU backend repacks
  (``CPU_REPACK``: Q4_0/Q4_K/IQ4_NL ... on x86 AVX2) are also copied into anonymous memory, and
  their mapped pages stay resident after loading. Which tensor goes where is llama.cpp's decision: a
  metadata-only load (``no_alloc``) with every tensor routed through the CPU buffer list, asked tensor by tensor
  (``llama_rq_model_tensor_buft``);
- KV cache and compute buffers: a dry ``llama_init_from_model`` on that load, with the server's
  parameters (context, slots, batch sizes, flash attention, cache types), asked with ``llama_rq_get_memory``
  (no figure is read from llama.cpp's log). The compute buffer counted is the graph the server runs (one
  row of logits per slot); its n_batch-row reservation stays virtual memory;
- deferred-prefill transient (``--deferred``): F16 K and V of every cache cell, eq. 12 of the
  RotaryQuant paper (2 x L x H_kv x d x T x 2 bytes) with llama.cpp's own per-cache sizes from a dry
  F16 context (an SWA layer's cache holds its window, not T). The prompt graphs of deferred prefill
  need more working memory, which llama.cpp does not reserve in advance: that part is not predicted;
- the server process itself (code, heap, vocabulary): constants measured on this build (``BASE``).

The peak is the larger of serving (above) and loading (the whole file is read in, MAP_POPULATE, while
the repacked copies are made).

For a weights recipe that is not a file yet, a *skeleton* GGUF is written: the source's metadata and
tensor infos with the recipe's types, its data region a sparse hole (no disk space, never read), so
llama.cpp accounts for the converted model exactly as it will load it. Kurtosis promotions (which
rq-convert measures while converting) are not predicted.

Quality comes only from measured tables (docs/results/*.json): KLD against the model's own F16 run,
each number with the model and context it was measured on. A candidate whose quality was not
measured on this model shows "unknown" and the measurements on other models as evidence.

The package, by job: ``facts`` (the model: GGUF header through :mod:`rotaryquant.gguf_io`, HF folders),
``models`` (the models our tables were measured on), ``results`` (the docs/results tables), ``weights``
(recipes and the types they give), ``costing`` (bytes, ranking and the Plan), ``planner`` (make_plan),
``commands`` (the winner's command lines) and ``render`` (text and JSON). llama.cpp's dry runs are the bindings'
(:mod:`rotaryquant.bindings.accounting`); ``rq-plan --verify`` is :mod:`rotaryquant.plan_verify`.
"""

from __future__ import annotations

from rotaryquant.bindings.accounting import N_BATCH, N_UBATCH, ContextCost, DryRun, NoAllocModel, dry_run
from rotaryquant.errors import PlanError
from rotaryquant.gguf_io import TensorInfo, tensor_bytes
from rotaryquant.plan.commands import expert_rule
from rotaryquant.plan.costing import (BASE, BASE_PER_TOKEN, EXPERTS, PAGE, Candidate, Plan, base_bytes,
                                      cpu_costs, deferred_transient, gpu_costs, kv_bits, sort,
                                      transient_bytes)
from rotaryquant.plan.errors import MiB, mib, parse_size
from rotaryquant.plan.facts import (Header, calib_possible, head_widths, hf_header, layer_dims, read_header,
                                    resolve, write_skeleton)
from rotaryquant.plan.models import KNOWN_MODELS, KnownModel, identify
from rotaryquant.plan.planner import KV_DEFAULT, KV_SPECS, RECIPES, NoFit, make_plan
from rotaryquant.plan.render import render, to_json
from rotaryquant.plan.results import RESULTS, Measurement, Quality, kv_quality, load_measurements
from rotaryquant.plan.weights import Weights, recipe_types, role_bytes, weights_options

# the names plan.py had for these (tests and rq-plan --verify use them)
_EXPERTS = EXPERTS
_head_widths = head_widths
_layer_dims = layer_dims
_kv_bits = kv_bits
_kv_quality = kv_quality
_role_bytes = role_bytes
_sort = sort

__all__ = [
    "BASE", "BASE_PER_TOKEN", "EXPERTS", "KNOWN_MODELS", "KV_DEFAULT", "KV_SPECS", "MiB", "N_BATCH", "N_UBATCH",
    "PAGE", "RECIPES", "RESULTS", "Candidate", "ContextCost", "DryRun", "Header", "KnownModel", "Measurement",
    "NoAllocModel", "NoFit", "Plan", "PlanError", "Quality", "TensorInfo", "Weights", "base_bytes",
    "calib_possible", "cpu_costs", "deferred_transient", "dry_run", "expert_rule", "gpu_costs", "head_widths",
    "hf_header", "identify", "kv_bits", "kv_quality", "layer_dims", "load_measurements", "make_plan", "mib",
    "parse_size", "read_header", "recipe_types", "render", "resolve", "role_bytes", "sort", "tensor_bytes",
    "to_json", "transient_bytes", "weights_options", "write_skeleton",
    "_EXPERTS", "_head_widths", "_layer_dims", "_kv_bits", "_kv_quality", "_role_bytes", "_sort",
]
