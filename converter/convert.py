"""``convert()``: HF folder / repo id / GGUF -> one GGUF with a per-role (and per-statistic) type mix.

The output is written to a hidden temporary file in the output folder (plus a spill file for the
tensor data) and renamed onto the target only after everything succeeded; on any error both
temporary files are removed and a :class:`ConvertError` says what went wrong and how to fix it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
from gguf import GGML_QUANT_VERSION
from gguf import GGUFValueType as V
from tqdm import tqdm

from rotaryquant import paths
from rotaryquant.converter import calibrate_step, gguf_source, hf
from rotaryquant.converter import calibration as C
from rotaryquant.converter import roles as R
from rotaryquant.converter.calibrate_step import (_check_calibration_used, _dry_run_calibration_note,
                                                  itq3_wanted, resolve_calibration)
from rotaryquant.converter.calibration import Identity, Stats
from rotaryquant.converter.errors import ConvertError
from rotaryquant.converter.imatrix import check_shape, load_imatrix
from rotaryquant.converter.options import Options, Result
from rotaryquant.converter.qtypes import FLOAT_TYPES, QT, file_type_for, quantize, type_name
from rotaryquant.converter.recipes import Planner, get_recipe, parse_override
from rotaryquant.converter.writer import META_PREFIX, StreamingWriter
from rotaryquant.errors import RQError
from rotaryquant.files import publish

log = logging.getLogger("rq-convert")
FORMAT_VERSION = 1  # bump when the rotaryquant.converter.* metadata changes meaning


def tool_version() -> str:
    try:
        pkg = version("rotaryquant")
    except Exception:  # noqa: BLE001
        pkg = "unknown"
    return f"rq-convert {pkg} (format {FORMAT_VERSION})"


# --- output handling --------------------------------------------------------------------------------

def _check_output(out: Path, src: Path) -> Path:
    out = Path(out).expanduser()
    if out.is_dir():
        raise ConvertError(f"output {out} is a folder", fix="give a file name, e.g. model.gguf")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ConvertError(f"output folder {parent} does not exist", fix="create it first")
    with contextlib.suppress(OSError):
        if out.resolve() == src.resolve():
            raise ConvertError(f"output {out} is the input file", fix="write to another file name")
    if out.exists() and not os.access(out, os.W_OK):
        raise ConvertError(f"output {out} exists and is not writable", fix="remove it or choose another name")
    return out


def _tmp(parent: Path, name: str, suffix: str) -> Path:
    try:
        fd, p = tempfile.mkstemp(dir=parent, prefix=f".{name}.", suffix=suffix)
    except OSError as e:
        raise ConvertError(f"cannot write to the output folder {parent} ({e.strerror or e})",
                           fix="choose a writable folder") from None
    os.close(fd)
    return Path(p)


def _io_error(e: OSError, src: Path, out: Path) -> ConvertError:
    if e.errno == errno.ENOSPC:
        return ConvertError(f"no space left on the device of {out.parent} while writing {out.name}",
                            fix="free some space or write the output elsewhere")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ConvertError(f"cannot write {out} ({e.strerror})", fix="choose a writable output folder")
    where = f" ({e.filename})" if e.filename else ""
    return ConvertError(f"I/O error converting {src} to {out}{where}: {e.strerror or e}",
                        fix="check the input files and free space, then retry")


# --- the per-tensor sink ----------------------------------------------------------------------------

def eager(t: Any) -> np.ndarray:
    """A real ndarray for what upstream hands the writer: with the torch backend, a lazy tensor
    (np.asarray of one would silently give its all-zero meta array) or a row-chunked one."""
    if isinstance(t, gguf.LazyBase):
        return np.asarray(type(t).to_eager(t))
    if isinstance(t, gguf.LazyChunkedTensor):
        if t._qtype is not None:
            raise ConvertError("upstream handed over an already-quantising chunked tensor")
        flat = np.concatenate([np.asarray(c()).reshape(-1) for c in t._chunks])
        return flat.view(t.dtype).reshape(t.shape) if flat.dtype != t.dtype else flat.reshape(t.shape)
    return np.asarray(t)


def _make_sink(planner: Planner, keep_float: Callable[[str], bool | None], imatrix: dict[str, np.ndarray],
               opts: Options, bar: Any, result: Result) -> Callable[..., Any]:
    stats = result.calibration

    def sink(name: str, tensor: Any, raw_dtype: Any) -> tuple[np.ndarray, QT] | None:
        if raw_dtype is not None and QT(raw_dtype) not in FLOAT_TYPES:
            return None                                   # already-packed bytes (upstream's own quantisers)
        arr = eager(tensor)
        if arr.dtype.kind != "f":
            return None                                   # integer tables are written as they are
        keep = keep_float(name)
        if keep is None:
            return None
        if not keep and not np.isfinite(arr).all():
            bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
            raise ConvertError(f"tensor {name} has {bad} NaN/Inf value(s)", fix="the checkpoint is corrupt; "
                               "re-download it")
        im = imatrix.get(name)
        if im is not None:
            check_shape(im, name, arr.shape)
        d = planner.decide(name, arr, keep_float=keep)
        if bar is not None:
            bar.update(arr.size)
        if opts.dry_run:
            return None
        xtx = None
        if stats is not None and name in stats.shapes:
            if tuple(arr.shape[-2:]) != stats.shapes[name]:
                raise ConvertError(f"calibration statistics for {name} are for shape {stats.shapes[name]}, the "
                                   f"tensor is {tuple(arr.shape)}", fix="measure them on this model with --calibrate")
            if d.qtype == QT.ITQ3_S:
                xtx = stats.for_tensor(name)
        q = quantize(arr, d.qtype, None if d.qtype in FLOAT_TYPES else im, xtx=xtx, threads=opts.threads)
        if xtx is not None:
            result.calibrated.append(name)
        return q, d.qtype

    return sink


def _finalize(planner: Planner, opts: Options, src: Path, imatrix_path: Path | None,
              result: Result) -> Callable[[Any], None]:
    def before_header(w: StreamingWriter) -> None:
        stats = result.calibration
        if stats is not None and opts.calibration_data and result.kind == "hf":
            _check_hf_vocab(stats, w, src)
        ft = file_type_for(planner.weights_per_type())
        w.set_kv("general.file_type", int(ft), V.UINT32)
        rc = planner.recipe
        w.set_kv(META_PREFIX + "version", tool_version(), V.STRING)
        w.set_kv(META_PREFIX + "recipe", rc.name, V.STRING)
        w.set_kv(META_PREFIX + "recipe_roles", [f"{k}={v}" for k, v in rc.table().items()], V.ARRAY, V.STRING)
        w.set_kv(META_PREFIX + "role_types", [f"{k}={','.join(v)}" for k, v in planner.role_types().items()],
                 V.ARRAY, V.STRING)
        w.set_kv(META_PREFIX + "kurtosis_threshold", float(planner.threshold), V.FLOAT32)
        if planner.imatrix:
            w.set_kv(META_PREFIX + "act_kurtosis_threshold", float(planner.act_threshold), V.FLOAT32)
        promoted = [d.name for d in planner.decisions if d.promoted]
        if promoted:
            w.set_kv(META_PREFIX + "promoted", promoted, V.ARRAY, V.STRING)
        if planner.overrides:
            w.set_kv(META_PREFIX + "tensor_types", [o.text for o in planner.overrides], V.ARRAY, V.STRING)
        if imatrix_path is not None:
            w.set_kv(META_PREFIX + "imatrix", imatrix_path.name, V.STRING)
        w.set_kv(META_PREFIX + "source", src.name, V.STRING)
        if stats is not None:
            _write_calibration(w, stats, result)

    return before_header


def _kv_type(v: Any) -> tuple[Any, Any, Any]:
    if isinstance(v, np.ndarray):
        return v.tolist(), V.ARRAY, V.INT32 if v.dtype.kind == "i" else V.FLOAT32
    if isinstance(v, str):
        return v, V.STRING, None
    if isinstance(v, (int, np.integer)):
        return int(v), V.UINT32, None
    return float(v), V.FLOAT32, None


def _write_calibration(w: StreamingWriter, stats: Stats, result: Result) -> None:
    if stats.kcal is not None:
        for k, v in stats.kcal.metadata().items():   # the same keys rq-calibrate writes
            w.set_kv(k, *_kv_type(v))
    w.set_kv(META_PREFIX + "calibration", f"{stats.n_tokens} tokens of {stats.text_name} "
             f"(sha256 {stats.text_sha256[:16]})", V.STRING)
    if result.calibrated:
        w.set_kv(META_PREFIX + "calibrated", list(result.calibrated), V.ARRAY, V.STRING)


def _calibration(kind: str, src: Path, parent: Path, name: str, planner: Planner, opts: Options,
                 result: Result) -> Stats | None:
    """The statistics for this conversion: loaded (--calibration-data) or measured in one pass over the
    source (a GGUF) or a temporary Q8_0 conversion of it (an HF model), deleted afterwards."""
    want = itq3_wanted(planner)
    if opts.calibration_data:
        stats = C.Stats.load(opts.calibration_data)
        if kind == "gguf":
            r = gguf_source.open_gguf(src)
            stats.check(C.Identity.of_gguf(src, r), C.gguf_shapes(src, r), what=src.name)
        result.notes.append(f"calibration statistics from {Path(opts.calibration_data).name}: {stats.summary()}")
        return stats
    if opts.calibrate is None:
        return None
    data, text_name = calibrate_step.calibration_input(opts)
    tmp_q8 = None
    try:
        if kind == "gguf":
            model = src
        else:
            # the recursion: HF -> Q8_0 first
            tmp_q8 = _tmp(parent, name, ".calib.tmp")
            log.info("converting %s to a temporary Q8_0 GGUF for calibration", src)
            convert(src, tmp_q8, Options(recipe="q8_0", tensor_backend=opts.tensor_backend, threads=opts.threads,
                                         progress=opts.progress, verbose=opts.verbose))
            model = tmp_q8
        stats = calibrate_step.measure(model, data, text_name, want, opts, what=src.name,
                                       required=not result.calibration_default)
        if stats is None:
            result.notes.append(f"not calibrated: no weight of {src.name} becomes ITQ3_S with rows of a multiple of "
                                "256 values, and K centring does not apply")
            return None
    finally:
        if tmp_q8 is not None:
            with contextlib.suppress(OSError):
                tmp_q8.unlink()
    if result.calibration_default:
        result.notes.append(f"calibrated by default ({opts.recipe} emits ITQ3_S, which without statistics loses to "
                            "IQ3_S+imatrix); --no-calibrate skips it, --save-calibration keeps the statistics")
    result.notes.append(stats.summary())
    result.notes.extend(stats.notes)
    if opts.save_calibration:
        result.notes.append(f"calibration statistics saved to {stats.save(opts.save_calibration)}")
    return stats


def _check_hf_vocab(stats: Stats, w: StreamingWriter, src: Path) -> None:
    tok = w.kv_data[0].get("tokenizer.ggml.tokens")
    if tok is None:
        raise ConvertError(f"{src} has no vocabulary to check the calibration statistics against")
    stats.check(Identity.of_tokens(w.arch, list(tok.value)), stats.model_tensors, what=src.name)


def _progress(total: int, opts: Options) -> Any:
    if not opts.progress:
        return None

    return tqdm(total=total, unit="w", unit_scale=True, desc="rq-convert", file=sys.stderr, leave=False,
                dynamic_ncols=True)


# --- the two sources --------------------------------------------------------------------------------

def _convert_hf(folder: Path, tmp_out: Path, data_file: Any, planner: Planner, imatrix: dict, opts: Options,
                before_header: Callable, result: Result) -> None:
    root = paths.llama_root()
    if not (root / "conversion").is_dir():
        raise ConvertError(f"llama.cpp's converter is not at {root}/conversion", fix="run `make setup`")
    src = hf.inspect_folder(folder, root)
    result.n_weights = src.n_weights
    backend = hf.choose_backend(opts.tensor_backend, src.arch)
    result.backend = backend
    if backend == "numpy" and src.arch not in hf.NUMPY_VERIFIED:
        note = (f"{src.arch} (conversion/{src.module}.py) is not verified on the numpy tensor backend; "
                "if conversion fails or the model misbehaves, install torch and use --tensor-backend torch")
        result.notes.append(note)
        log.warning(note)
    bar = _progress(src.n_weights, opts)
    holder: dict[str, Any] = {}
    sink = _make_sink(planner, lambda n: holder["model"]._rq_keep_float.get(n), imatrix, opts, bar, result)

    def make_writer(arch: str, old: Any) -> StreamingWriter:
        return StreamingWriter(arch, sink=sink, data_file=data_file, dry_run=opts.dry_run,
                               before_header=before_header, endianess=old.endianess)

    tmode: Any = contextlib.nullcontext()
    if backend == "torch":
        import torch  # lazy: optional (--tensor-backend torch), heavy

        tmode = torch.inference_mode()
    try:
        with hf.quiet_upstream(opts.verbose), tmode:
            model = hf.build_model(src, backend, root, tmp_out, make_writer)
            holder["model"] = model
            planner.tied = hf.output_is_tied(model)
            planner.n_layers = getattr(model, "block_count", None)
            if opts.dry_run:
                model.prepare_tensors()
            else:
                model.write()
    except hf.shim_errors() as e:
        raise ConvertError(f"the numpy tensor backend cannot convert {src.arch} ({e})",
                           fix="pip install torch and rerun with --tensor-backend torch") from e
    finally:
        if bar is not None:
            bar.close()


def _convert_gguf(path: Path, tmp_out: Path, data_file: Any, planner: Planner, imatrix: dict, opts: Options,
                  before_header: Callable, result: Result) -> None:
    r = gguf_source.open_gguf(path)
    names = [t.name for t in r.tensors]
    planner.tied = "output.weight" not in names
    planner.n_layers = R.n_layers(names)
    result.n_weights = int(sum(int(t.n_elements) for t in r.tensors))
    keep: dict[str, bool] = {}
    for t in r.tensors:
        role = R.classify(t.name, len(t.shape))
        keep[t.name] = role in R.KEPT_F32 or (gguf_source.stored_f32(t) and role == R.OTHER)
    sink = _make_sink(planner, keep.get, imatrix, opts, bar := _progress(result.n_weights, opts), result)
    w = StreamingWriter(gguf_source.architecture(r), sink=sink, data_file=data_file, dry_run=opts.dry_run,
                        before_header=before_header)
    gguf_source.copy_metadata(r, w)
    w.set_kv("general.quantization_version", GGML_QUANT_VERSION, V.UINT32)
    try:
        for name, t in gguf_source.tensors(r):
            try:
                data = gguf_source.dequantize(t)
            except (ValueError, NotImplementedError) as e:
                raise ConvertError(f"{path}: cannot dequantise {name} ({t.tensor_type.name}: {e})") from None
            w.add_tensor(name, data, raw_dtype=QT.F32)
            del data
        if opts.dry_run:
            return
        w.write_header_to_file(tmp_out)
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=False)
    finally:
        w.close()
        if bar is not None:
            bar.close()


# --- entry point ------------------------------------------------------------------------------------

def convert(source: str | Path, output: str | Path | None, opts: Options | None = None) -> Result:
    """Convert ``source`` (HF folder, repo id or GGUF) to ``output`` (ignored, may be None, for a dry run)."""
    opts = opts or Options()
    t0 = time.perf_counter()
    recipe = get_recipe(opts.recipe)
    overrides = [parse_override(s) for s in opts.tensor_types]
    im_path = Path(opts.imatrix).expanduser() if opts.imatrix else None
    imatrix = load_imatrix(im_path) if im_path is not None else {}
    kind, src = hf.resolve_input(source)
    planner = Planner(recipe, overrides=overrides, threshold=opts.kurtosis_threshold,
                      act_threshold=opts.act_kurtosis_threshold, promote=opts.promote, imatrix=imatrix,
                      measure=opts.measure)
    result = Result(src, kind, None, planner, 0.0, 0)
    opts, result.calibration_default = resolve_calibration(opts, planner)
    if opts.save_calibration and opts.calibrate is None:
        raise ConvertError("--save-calibration has nothing to save: this conversion does not calibrate",
                           fix="add --calibrate (or drop --no-calibrate / --calibration-data)")

    if opts.dry_run:
        parent, out = Path(tempfile.gettempdir()), None
    else:
        if output is None:
            raise ConvertError("no output file given", fix="rq-convert SOURCE OUT.gguf")
        out = _check_output(Path(output), src)
        parent = out.parent if str(out.parent) else Path(".")
    name = out.name if out is not None else "dry-run"
    tmp_out = _tmp(parent, name, ".tmp")
    data_path = _tmp(parent, name, ".data")
    ok = False
    try:
        with open(data_path, "w+b") as data_file:
            run = _convert_hf if kind == "hf" else _convert_gguf
            if not opts.dry_run:
                result.calibration = _calibration(kind, src, parent, name, planner, opts, result)
            run(src, tmp_out, data_file, planner, imatrix, opts,
                _finalize(planner, opts, src, im_path, result), result)
            if opts.dry_run and (opts.calibrate is not None or opts.calibration_data):
                result.notes.append(_dry_run_calibration_note(kind, planner, opts, result))
            _check_calibration_used(result, opts)
        if not opts.dry_run:
            assert out is not None
            publish(tmp_out, out)
            result.output = out
            result.output_bytes = out.stat().st_size
            result.file_type = file_type_for(planner.weights_per_type()).name
        ok = True
    except RQError:  # ours already (a missing build among them): one line as it is
        raise
    except OSError as e:
        raise _io_error(e, src, out or parent) from e
    except MemoryError:
        raise ConvertError(f"out of memory converting {src}", fix="close other programs or use a larger machine") \
            from None
    except Exception as e:  # noqa: BLE001 (anything upstream raises becomes one line; --verbose shows the cause)
        raise ConvertError(f"converting {src} failed: {type(e).__name__}: {e}") from e
    finally:
        for p in (data_path, tmp_out) if not ok else (data_path,):
            with contextlib.suppress(OSError):
                p.unlink()
        if opts.dry_run:
            with contextlib.suppress(OSError):
                tmp_out.unlink()
    result.seconds = time.perf_counter() - t0
    return result


__all__ = ["Options", "Result", "convert", "tool_version", "type_name"]
