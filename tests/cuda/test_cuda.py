"""The CUDA kernels without a GPU: the lane model (a numpy transcription of the kernels' lane layout,
shuffles and operation order, checked against the C references), and an nvcc compile of our units
and of the upstream units patch 0008 touches (sm_90), so a CUDA compile error fails CI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from rotaryquant import paths


def test_lane_model_matches_the_references():
    proc = subprocess.run([sys.executable, str(paths.REPO / "scripts" / "cuda" / "lane-model.py")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")),
                    reason="no nvcc on this machine: the CUDA compile check needs the CUDA toolkit")
def test_cuda_units_compile_for_sm90(upstream_tree):
    proc = subprocess.run(["bash", str(paths.REPO / "scripts" / "cuda" / "ci-compile.sh"), "--tree", str(upstream_tree)],
                          capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
