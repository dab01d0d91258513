"""Can a forward whose softmax overlaps its own tensor-core products beat the shipped rbf forward?  A causal rbf forward
written in Gluon (``triton.experimental.gluon``, in triton 3.6) with FlashAttention-3's order inside one loop: the next
key tile's ``q k^T`` is in flight while this tile's softmax runs, and this tile's ``p v`` while the next tile's
softmax runs, with explicit waits (``warpgroup_mma_wait(num_outstanding=1)``), TMA loads into two stages of shared
memory per key / value tile, mbarriers per stage.  Triton's ``tl.dot`` waits for every product before the softmax in
each loop form tried (``benchmarks/results/offline-sm90-2026-11-29d``); Gluon states the waits itself.

    PYTHONPATH=. python benchmarks/probe_gluon_forward.py --out DIR [--d 64,128] [--n 1024,2048,4096,8192]
        [--tokens 32768] [--heads 16] [--rounds 3]

Forward only, bf16, one process: this kernel (its tile configs one by one), the shipped forward
(``kernels_flash_fwd.distance_forward``), ``probe_hopper_forward``'s tutorial-shaped kernel and SDPA's flash and
cuDNN backends; each Gluon cell is checked against the naive float32 attention of the first batch element (relative
error reported; a wrong kernel's time is marked, not hidden).  The score is ``probe_hopper_forward``'s NORM 1 form:
``2 c q.k log2 e`` plus the key-norm bias vector ``-c ||k||^2 log2 e`` (one fp32 load per key tile).  Gluon has no
CPU interpreter: this kernel is checked on the GPU only (``--check``: every config and head dim against the
reference, exit code 1 on a mismatch); ``offline_kernel_report.py --cases gluon`` compiles it for sm_90 without one,
which CI does (``tests/test_benchmark_offline_report.py``: no spills, a product left in flight across a wait).

This is a probe, not a shipped kernel: what it finds decides whether the shipped forward moves to Gluon.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

# TMA's global-to-shared load: `async_load` from triton 3.7 on (3.9 removed the old name), `async_copy_global_to_shared`
# in triton 3.6 (the GPU machines')
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

# (BLOCK_M, BLOCK_N, num_warps): 128 query rows over one warpgroup (4 warps: 32 rows each) or two (8 warps: each
# warpgroup 64 rows, FlashAttention-3's consumer split without its producer warps)
CONFIGS = [(128, 64, 8), (128, 64, 4), (128, 128, 8)]


@gluon.jit
def _load_tile(desc, smem, bar, row, pred=True):
    """One TMA load of ``desc``'s block at ``[row, 0]`` into ``smem``, completing ``bar`` (none where ``pred`` is
    false)."""
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    _tma_load(desc, [row, 0], bar, smem, pred=pred)


@gluon.jit
def _softmax(s, m_i, l_i, KB, y0, start_n, row0, a, DIAGONAL, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             s_layout: gl.constexpr):
    """Tile scores from the raw product ``s``, and the online softmax's ``(p, alpha, m, l)``."""
    cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=cols)
    s = s * a + gl.load(KB + y0 + offs_n)[None, :]
    if DIAGONAL:  # the row block's own keys: causal mask
        offs_m = row0 + gl.arange(0, BLOCK_M, layout=rows)
        s = gl.where(offs_m[:, None] >= offs_n[None, :], s, -1.0e6)
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _gluon_rbf_fwd(q_desc, k_desc, v_desc, KB, C, OUT, LSE, N, H,
                   D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """Causal rbf forward of one 128-row block of one (batch, head); ``N`` a multiple of ``BLOCK_M``.

    FlashAttention-3's intra-warpgroup order per key tile ``j`` (two shared-memory stages each for keys and values,
    refilled as soon as the product that read a stage is known to be done): issue ``S_j = q k_j^T``; rescale ``O``
    by the previous tile's ``alpha``; issue ``O += P_{j-1} v_{j-1}``; wait for ``S_j`` only (one product left in
    flight); the softmax of ``S_j`` runs while ``P_{j-1} v_{j-1}`` does; wait for it.  (``O`` is never read while a
    product of it is in flight: ptxas serialises every product of a loop that does, C7514.)"""
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    y0 = bh * N
    row0 = pid_m * BLOCK_M
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, BLOCK_N, D], v_desc.layout)
    # barriers: 0 the query block, 1-2 the key stages, 3-4 the value stages
    bars = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(5):
        mbarrier.init(bars.index(i), count=1)

    a = gl.load(C + bh % H).to(gl.float32) * 2.8853900817779268  # 2 c log2(e)
    n_tiles = (row0 + BLOCK_M) // BLOCK_N  # keys 0 .. row0 + BLOCK_M - 1
    first_diagonal = row0 // BLOCK_N

    _load_tile(q_desc, q_smem, bars.index(0), y0 + row0)
    for i in gl.static_range(2):  # (every load issued is waited for before the program ends)
        _load_tile(k_desc, k_smem.index(i), bars.index(1 + i), y0 + i * BLOCK_N, pred=i < n_tiles)
        _load_tile(v_desc, v_smem.index(i), bars.index(3 + i), y0 + i * BLOCK_N, pred=i < n_tiles)
    mbarrier.wait(bars.index(0), phase=0)
    mbarrier.wait(bars.index(1), phase=0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    _load_tile(k_desc, k_smem.index(0), bars.index(1), y0 + 2 * BLOCK_N, pred=n_tiles > 2)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, KB, y0, 0, row0, a, first_diagonal == 0, BLOCK_M, BLOCK_N, s_layout)
    o = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    for j in range(1, n_tiles):
        stage = j % 2
        prev = 1 - stage
        mbarrier.wait(bars.index(1 + stage), phase=(j // 2) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)),
                          gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        # while S_j runs: rescale O (no product of it in flight) and issue O += P_{j-1} v_{j-1}
        o = o * gl.convert_layout(alpha, rows_o)[:, None]
        mbarrier.wait(bars.index(3 + prev), phase=((j - 1) // 2) & 1)
        o = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_smem.index(prev), o, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S_j done; P_{j-1} v_{j-1} runs on
        # key stage `stage` is free: tile j + 2 goes there
        _load_tile(k_desc, k_smem.index(stage), bars.index(1 + stage), y0 + (j + 2) * BLOCK_N, pred=j + 2 < n_tiles)
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, KB, y0, j * BLOCK_N, row0, a, j >= first_diagonal, BLOCK_M,
                                      BLOCK_N, s_layout)
        # (ptxas moves this wait above the softmax's row maximum and exponentials: only the score formation runs
        # with the value product in flight; benchmarks/results/offline-sm90-2026-11-29d)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        # value stage `prev` is free: tile j + 1 goes there
        _load_tile(v_desc, v_smem.index(prev), bars.index(3 + prev), y0 + (j + 1) * BLOCK_N, pred=j + 1 < n_tiles)
    # the last tile's values
    j_last = n_tiles - 1
    o = o * gl.convert_layout(alpha, rows_o)[:, None]
    mbarrier.wait(bars.index(3 + j_last % 2), phase=(j_last // 2) & 1)
    o = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_smem.index(j_last % 2), o)
    for i in gl.static_range(5):
        mbarrier.invalidate(bars.index(i))

    l_o = gl.convert_layout(l_i, rows_o)
    o = o / l_o[:, None]
    offs_m = row0 + gl.arange(0, BLOCK_M, layout=rows_o)
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    gl.store(OUT + (y0 + offs_m)[:, None] * D + offs_d[None, :], o.to(gl.bfloat16))
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    gl.store(LSE + y0 + row0 + gl.arange(0, BLOCK_M, layout=rows_s), m_i + gl.log2(l_i))


def gluon_forward(q, k, v, c, kb, cfg=(128, 64, 8)):
    """``(out, lse)`` of the Gluon probe: ``q, k, v [B, H, N, D]`` bf16 contiguous, ``c [H]`` fp32, ``kb [B, H, N]``
    fp32 (``probe_hopper_forward.key_bias_vector``); ``N`` a multiple of ``BLOCK_M``."""
    bsz, heads, n, d = q.shape
    bm, bn, warps = cfg
    if q.dtype != torch.bfloat16 or n % bm or bm % bn:
        raise ValueError(f"bf16 inputs with N ({n}) a multiple of BLOCK_M ({bm}), itself of BLOCK_N ({bn}) only")
    flat = [t.reshape(bsz * heads * n, d) for t in (q, k, v)]
    layout_q = gl.NVMMASharedLayout.get_default_for([bm, d], gl.bfloat16)
    layout_kv = gl.NVMMASharedLayout.get_default_for([bn, d], gl.bfloat16)
    q_desc = TensorDescriptor.from_tensor(flat[0], [bm, d], layout_q)
    k_desc = TensorDescriptor.from_tensor(flat[1], [bn, d], layout_kv)
    v_desc = TensorDescriptor.from_tensor(flat[2], [bn, d], layout_kv)
    out = torch.empty_like(q)
    lse = torch.empty(bsz, heads, n, device=q.device, dtype=torch.float32)
    _gluon_rbf_fwd[(n // bm, bsz * heads)](q_desc, k_desc, v_desc, kb, c, out, lse, n, heads, D=d, BLOCK_M=bm,
                                           BLOCK_N=bn, num_warps=warps)
    return out, lse


def main() -> int:
    import probe_hopper_forward as hopper

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gluon_forward")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--n", default="1024,2048,4096,8192")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--check", action="store_true", help="only the correctness of every config and head dim")
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    from hf_rbf.kernels_flash_fwd import distance_forward

    os.makedirs(args.out, exist_ok=True)
    started = time.time()
    rows, failures = [], []
    for d in (int(x) for x in args.d.split(",")):
        for n in (int(x) for x in args.n.split(",")):
            b = max(1, args.tokens // n)
            q, k, v, c = hopper.inputs(b, args.heads, n, d)
            kb = hopper.key_bias_vector(k, c)
            ref = hopper.naive(q[:1].float(), k[:1].float(), v[:1].float(), c, 1)
            fns, errors = {}, {}
            for cfg in CONFIGS:
                name = f"gluon {cfg}"
                try:
                    out = gluon_forward(q, k, v, c, kb, cfg)[0]
                    torch.cuda.synchronize()
                    errors[name] = hopper.rel_err(out[:1], ref)
                    fns[name] = lambda cfg=cfg: gluon_forward(q, k, v, c, kb, cfg)[0]
                except Exception as e:  # noqa: BLE001 (a config that does not compile is a finding)
                    failures.append(f"D{d} N{n} {name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                    print(failures[-1], flush=True)
            if args.check:
                for name, err in errors.items():
                    print(f"D{d} N{n} {name}: relative error {err:.2e}", flush=True)
                    if not err < 2e-2:
                        failures.append(f"D{d} N{n} {name}: relative error {err:.2e}")
                continue
            fns["shipped rbf forward"] = lambda: distance_forward(
                q, k, v, None, None, None, None, c, None, causal=True, window=None, num_prefix_keys=0,
                normalize=True, qnorm=False, kv_same=False, eps=0.0, knorm_inline=True)[0]  # fmt: skip
            fns["tutorial-shaped probe (bias vector)"] = lambda: hopper.probe_forward(
                q, k, v, c, kb, 1, "plain", (128, 64, 4, 3))[0]  # fmt: skip
            backends = (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION))
            for label, backend in backends:

                def sdpa(backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=2 * c[0].item())

                fns[label] = sdpa
            best = {}
            for _ in range(args.rounds):  # every call once per round (interleaved), best round kept
                for name, fn in fns.items():
                    t = hopper.events_ms(fn, args.iters)
                    best[name] = min(best.get(name, float("inf")), t)
            flash = best["SDPA flash"]
            for name, t in best.items():
                rows.append(dict(d=d, n=n, b=b, name=name, ms=t, vs_flash=t / flash, error=errors.get(name)))
                print(f"D{d} N{n} {name}: {t:.3f} ms, {t / flash:.2f}x flash"
                      + (f", rel err {errors[name]:.1e}" if name in errors else ""), flush=True)
    meta = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), seconds=round(time.time() - started))
    with open(os.path.join(args.out, "gluon_forward.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, failures=failures), f, indent=1)
    with open(os.path.join(args.out, "gluon_forward.md"), "w") as f:
        f.write(f"# Gluon rbf forward probe\n\n{meta}\n\n")
        f.write("| D | N | call | ms | x flash | rel. error |\n|---|---|---|---|---|---|\n")
        for r in rows:
            err = "" if r["error"] is None else f"{r['error']:.1e}"
            f.write(f"| {r['d']} | {r['n']} | {r['name']} | {r['ms']:.3f} | {r['vs_flash']:.2f} | {err} |\n")
        for line in failures:
            f.write(f"\n- {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
