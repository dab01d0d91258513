"""benchmarks/offline_kernel_report.py's reading of a SASS listing: the loop bodies (a backward branch before the last
EXIT) and their per-element instruction mix.  Run in a subprocess: importing the report sets the process up for
offline compiles (no interpreter, no autotuning), which the other tests must not inherit."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   FMUL R2, R3, R4 ;
        /*0020*/                   FFMA R2, R5, R5, R2 ;
        /*0030*/                   MUFU.EX2 R6, R2 ;
        /*0040*/                   FADD R7, R7, R6 ;
        /*0050*/              @P0  BRA `(.L_x_0) ;
        /*0060*/                   F2FP.BF16.F32.PACK_AB R8, R6, R6 ;
.L_x_1:
        /*0070*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0080*/                   FMNMX R9, R9, R2, !PT ;
        /*0090*/              @!P1 BRA `(.L_x_1) ;
        /*00a0*/                   EXIT ;
.L_x_2:
        /*00b0*/                   NOP ;
        /*00c0*/                   BRA `(.L_x_2) ;
"""


def test_loops_and_their_instruction_mix_come_from_the_backward_branches():
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import offline_kernel_report as r; "
        f"t = {SASS!r}; print(r.sass_loops(t)); print(r.sass_loop_mix(t))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loops, mix = out.stdout.strip().splitlines()[-2:]
    # two loops before EXIT (the branch after it, a barrier retry in real listings, is left out)
    assert loops == "5/0/0 3/1/0"
    assert mix == "5: FADD 1 FMUL 1 FFMA 1 MUFU 1; 3: FMNMX 1"


def test_the_forward_probes_compile_for_sm90_without_a_gpu(tmp_path):
    """``--cases gluon,probe_bias_overlap``: benchmarks/probe_gluon_forward.py (Gluon, no CPU interpreter: this compile
    is what CI can check of it) and the overlap loop of probe_hopper_forward.py compile for sm_90 with this triton,
    without spills, and the Gluon loop keeps a product in flight across a wait (``DEPBAR.LE gsb0, 0x1``: the order it
    was written for; ptxas serialising its products would put a ``0x0`` wait after each)."""
    asm = tmp_path / "asm"
    out = subprocess.run(
        [sys.executable, "benchmarks/offline_kernel_report.py", "--cases", "gluon,probe_bias_overlap", "--n", "512",
         "--d", "64", "--out", str(tmp_path), "--asm-dir", str(asm)],  # fmt: skip
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.path.join(REPO, 'benchmarks')}"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    rows = json.loads((tmp_path / "report.json").read_text())
    assert {r["case"] for r in rows} == {"gluon", "probe_bias_overlap"}, rows
    for row in rows:
        assert "error" not in row, row.get("error")
        assert row["stack"] == 0, row
    sass = (asm / "gluon_gluon_rbf_fwd.sass").read_text()
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass
