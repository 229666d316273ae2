"""`bench.xla_kernels`: loop bodies read from SASS text by hand; the whole path (XLA's dump,
ptxas) where the CUDA plugin and a ptxas are here."""

import glob
import importlib.util
import json
import shutil

import pytest

from bench.xla_kernels import loop_bodies, main

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_CTAID.X ;
        /*0020*/                   FADD R2, R2, R3 ;
        /*0030*/              @!P0 FMUL R2, R2, 0.5 ;
        /*0040*/                   MUFU.EX2 R4, R2 ;
        /*0050*/               @P1 BRA 0x20 ;
        /*0060*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0070*/               @P2 BRA 0x60 ;
        /*0080*/                   BRA 0x90 ;
        /*0090*/                   EXIT ;
"""


def test_loop_bodies_are_the_backward_branches():
    assert loop_bodies(SASS) == [["FADD", "FMUL", "MUFU", "BRA"], ["HMMA", "BRA"]]


NEEDS_PLUGIN = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins") is None
    or not (shutil.which("ptxas") or glob.glob("/usr/local/cuda*/bin/ptxas")),
    reason="needs the CUDA plugin (make deviceless-plugin) and a ptxas")


@NEEDS_PLUGIN
def test_counts_the_prefill_kernels(tmp_path):
    main(["--tokens", "256", "--heads", "2", "--out", str(tmp_path / "k.json")])
    kernels = json.loads((tmp_path / "k.json").read_text())["kernels"]
    assert {"kda_chunk_inverse", "kda_chunk_prep"} <= set(kernels)
    for report in kernels.values():
        assert 0 < report["registers"] <= 255 and report["sass"] > max(report["loops"], default=0)


@NEEDS_PLUGIN
def test_counts_the_flash_attention_kernel_at_both_presets(tmp_path):
    main(["--op", "attention", "--tokens", "256", "--out", str(tmp_path / "a.json")])
    kernels = json.loads((tmp_path / "a.json").read_text())["kernels"]
    assert set(kernels) == {"flash_attention_kimi", "flash_attention_glm"}
    for report in kernels.values():
        assert 0 < report["registers"] <= 255 and len(report["loops"]) == 3


@NEEDS_PLUGIN
def test_counts_the_sparse_attention_kernel(tmp_path):
    main(["--op", "sparse", "--tokens", "16", "--out", str(tmp_path / "s.json")])
    kernels = json.loads((tmp_path / "s.json").read_text())["kernels"]
    assert set(kernels) == {"sparse_attention"}
    assert len(kernels["sparse_attention"]["loops"]) == 1
