"""What :func:`rotaryquant.converter.convert.convert` is asked (``Options``) and what it reports (``Result``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from rotaryquant.converter import kcenter
from rotaryquant.converter.calibration import Stats
from rotaryquant.converter.recipes import ACT_KURTOSIS_THRESHOLD, KURTOSIS_THRESHOLD, Planner


@dataclass
class Options:
    recipe: str = "rotaryquant"
    tensor_types: Sequence[str] = ()             # llama-quantize's --tensor-type REGEX=TYPE
    imatrix: str | Path | None = None
    kurtosis_threshold: float = KURTOSIS_THRESHOLD
    act_kurtosis_threshold: float = ACT_KURTOSIS_THRESHOLD
    promote: bool = True
    measure: bool | None = None                  # measure kurtosis even when nothing can be promoted
    dry_run: bool = False
    threads: int | None = None
    tensor_backend: str = "auto"                 # auto | numpy | torch (HF input only)
    progress: bool = True
    verbose: bool = False
    # second-order (ITQ3_S) and K-centring calibration, one llama.cpp pass (see calibration.py)
    calibrate: str | Path | None = None          # calibration text; "" = the packaged calibration text
    auto_calibrate: bool = True                  # calibrate=None: recipes that emit ITQ3_S calibrate anyway
    calibration_data: str | Path | None = None   # reuse statistics saved with save_calibration (.npz)
    save_calibration: str | Path | None = None   # also write the measured statistics there (.npz)
    calibration_tokens: int = kcenter.DEFAULT_TOKENS
    calibration_ctx: int = 2048


@dataclass
class Result:
    source: Path
    kind: str                                    # "hf" | "gguf"
    output: Path | None                          # None for a dry run
    planner: Planner
    seconds: float
    n_weights: int
    backend: str | None = None
    file_type: str | None = None
    output_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    calibration: Stats | None = None
    calibrated: list[str] = field(default_factory=list)   # tensors quantised with their Gram blocks
    calibration_default: bool = False                     # calibrated because the recipe emits ITQ3_S

    @property
    def weights_per_second(self) -> float:
        return self.n_weights / self.seconds if self.seconds > 0 else float("nan")
