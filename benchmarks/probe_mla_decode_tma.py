"""Probe: would TMA-fed latent tiles (and the transposed products) speed the paged MLA decode up?  The question
``mla_decode_tma`` was built on, asked of a stripped-down stage 1 before building it.

``stage1_tma`` is ``mla_decode``'s stage 1 reduced to full tiles (no masking of rows past a sequence's end, no left
padding, no fp32 path), with the 512 value columns in two 256-column halves (a TMA box holds at most 256 per
dimension) and the rope part apart; ``TMA`` loads the tiles from host tensor descriptors over the page pool's rows
instead of pointers, ``SWAP`` computes ``S^T = K Q^T`` and ``O^T = V^T P^T``.  Stage 2 is ``mla_decode``'s merge.

    python benchmarks/probe_mla_decode_tma.py                       # registers / spills for sm_90, no GPU needed
    python benchmarks/probe_mla_decode_tma.py 64 64 8 2             # ... at BLOCK_H BLOCK_N warps stages
    python benchmarks/probe_mla_decode_tma.py gpu OUT.json          # CUDA-graph timing against mla_decode (a GPU)

The timing uses full-length sequences (every tile full), scattered pages, bf16, page 64, 16 / 64 / 128 heads, and
records each variant's error against ``mla_decode_triton``'s output.  Results: ``mla_decode_tma_probe_h100.json``.
"""
import os
import sys
import triton
import triton.language as tl


@triton.jit
def stage1_tma(Q, KVD, KVR, KV, stride_kvt, BT, SEQ_LENS, O_PART, LSE, OUT, qk_scale, H, NUM_SPLITS,
               stride_qb, stride_qh, stride_btb, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
               stride_ob, stride_oh,
               PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
               ROPE: tl.constexpr, DIRECT_OUT: tl.constexpr, TMA: tl.constexpr, SWAP: tl.constexpr = False):
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b)
    n_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = (n_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    t_start = pid_s * tiles_per_split * BLOCK_N
    t_end = tl.minimum(t_start + tiles_per_split * BLOCK_N, seq_len)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_c = tl.arange(0, HALF)
    offs_r = tl.arange(0, ROPE)
    offs_n = tl.arange(0, BLOCK_N)
    q_row = Q + b * stride_qb + offs_h[:, None] * stride_qh
    q0 = tl.load(q_row + offs_c[None, :], mask=mask_h[:, None], other=0.0)
    q1 = tl.load(q_row + HALF + offs_c[None, :], mask=mask_h[:, None], other=0.0)
    qr = tl.load(q_row + 2 * HALF + offs_r[None, :], mask=mask_h[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc0 = tl.full([BLOCK_H, HALF], 0.0, dtype=tl.float32)
    acc1 = tl.full([BLOCK_H, HALF], 0.0, dtype=tl.float32)
    acc0t = tl.full([HALF, BLOCK_H], 0.0, dtype=tl.float32)
    acc1t = tl.full([HALF, BLOCK_H], 0.0, dtype=tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_btb
    for start in range(t_start, t_end, BLOCK_N):
        tok = start + offs_n
        mask_n = tok < t_end
        page = tl.load(bt_row + start // PAGE_SIZE)
        row0 = page * PAGE_SIZE + (start % PAGE_SIZE)
        if TMA:
            k0 = KVD.load([row0, 0])
            k1 = KVD.load([row0, HALF])
            kr = KVR.load([row0, 2 * HALF])
        else:
            rows = (row0.to(tl.int64) + offs_n) * stride_kvt
            ptr = KV + rows[:, None]
            k0 = tl.load(ptr + offs_c[None, :], mask=mask_n[:, None], other=0.0)
            k1 = tl.load(ptr + HALF + offs_c[None, :], mask=mask_n[:, None], other=0.0)
            kr = tl.load(ptr + 2 * HALF + offs_r[None, :], mask=mask_n[:, None], other=0.0)
        if SWAP:
            # transposed products: S^T = K Q^T, O^T = V^T P^T (the MMA's M is the token tile / value columns)
            st = tl.dot(k0, tl.trans(q0))
            st = tl.dot(k1, tl.trans(q1), acc=st)
            st = tl.dot(kr, tl.trans(qr), acc=st)
            st = tl.where(mask_n[:, None], st * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(st, 0))
            alpha = tl.exp2(m_i - m_new)
            pt = tl.exp2(st - m_new[None, :])
            l_i = l_i * alpha + tl.sum(pt, 0)
            pt = pt.to(k0.dtype)
            acc0t = tl.dot(tl.trans(k0), pt, acc=acc0t * alpha[None, :])
            acc1t = tl.dot(tl.trans(k1), pt, acc=acc1t * alpha[None, :])
        else:
            s = tl.dot(q0, tl.trans(k0))
            s = tl.dot(q1, tl.trans(k1), acc=s)
            s = tl.dot(qr, tl.trans(kr), acc=s)
            s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            # rows past the sequence may hold garbage (NaN): zero them for p @ V (TMA reads them unmasked)
            v0 = k0
            v1 = k1
            p = p.to(k0.dtype)
            acc0 = tl.dot(p, v0, acc=acc0 * alpha[:, None])
            acc1 = tl.dot(p, v1, acc=acc1 * alpha[:, None])
        m_i = m_new
    if SWAP:
        acc0 = tl.trans(acc0t)
        acc1 = tl.trans(acc1t)
    has_tok = l_i > 0.0
    inv_l = tl.where(has_tok, 1.0 / tl.where(has_tok, l_i, 1.0), 0.0)
    if DIRECT_OUT:
        o_row = OUT + b * stride_ob + offs_h[:, None] * stride_oh
        tl.store(o_row + offs_c[None, :], (acc0 * inv_l[:, None]).to(OUT.dtype.element_ty), mask=mask_h[:, None])
        tl.store(o_row + HALF + offs_c[None, :], (acc1 * inv_l[:, None]).to(OUT.dtype.element_ty), mask=mask_h[:, None])
    else:
        o_row = O_PART + b * stride_pb + offs_h[:, None] * stride_ph + pid_s * stride_ps
        tl.store(o_row + offs_c[None, :], acc0 * inv_l[:, None], mask=mask_h[:, None])
        tl.store(o_row + HALF + offs_c[None, :], acc1 * inv_l[:, None], mask=mask_h[:, None])
        lse = tl.where(has_tok, m_i + tl.log2(tl.where(has_tok, l_i, 1.0)), float("-inf"))
        tl.store(LSE + b * stride_lb + offs_h * stride_lh + pid_s, lse, mask=mask_h)


def compile_main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_resources import compile_sm90, usage
    from mla_fuser.kernels.mla_decode import _mla_decode_stage1
    bh, bn, warps, stages = [int(a) for a in (sys.argv[1:5] if len(sys.argv) > 4 else (16, 64, 4, 2))]
    base_types = {"Q": "*bf16", "QR": "*bf16", "KV": "*bf16", "BT": "*i32", "SEQ_LENS": "*i32", "STARTS": "*i32",
                  "O_PART": "*fp32", "LSE": "*fp32", "OUT": "*bf16", "qk_scale": "fp32"}
    c = dict(PAGE_SIZE=64, BLOCK_H=bh, BLOCK_N=bn, BLOCK_V=512, BLOCK_R=64, HAS_ROPE=True, EVEN_V=True, EVEN_R=True,
             PER_ROW_PAGES=False, DIRECT_OUT=False, DOT_PRECISION="tf32", DOT_UPCAST=False, SWAP_AB=False,
             HAS_STARTS=False)
    print("shipped     ", usage(compile_sm90(_mla_decode_stage1.get(), base_types, c, warps, stages)))
    for tma, swap in ((False, False), (True, False), (False, True), (True, True)):
        t = {"Q": "*bf16", "BT": "*i32", "SEQ_LENS": "*i32", "O_PART": "*fp32", "LSE": "*fp32", "OUT": "*bf16",
             "qk_scale": "fp32", "KV": "*bf16",
             "KVD": f"tensordesc<bf16[{bn}, 256]>" if tma else "*bf16",
             "KVR": f"tensordesc<bf16[{bn}, 64]>" if tma else "*bf16"}
        cc = dict(PAGE_SIZE=64, BLOCK_H=bh, BLOCK_N=bn, HALF=256, ROPE=64, DIRECT_OUT=False, TMA=tma, SWAP=swap)
        try:
            name = ("halves tma" if tma else "halves ptr") + (" swap" if swap else "")
            print(name, usage(compile_sm90(stage1_tma, t, cc, warps, stages)))
        except Exception as e:
            print("FAIL", tma, type(e).__name__, str(e)[:1500])


def gpu_main(out_path):
    """Time the shipped kernel against the halves prototype (pointers / TMA) by CUDA-graph replay."""
    import json
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor
    from mla_fuser.kernels import mla_decode as M
    dev = "cuda"
    torch.manual_seed(0)
    results = []

    def graph_time(fn, reps=20):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        torch.cuda.synchronize()
        best = []
        for _ in range(5):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            best.append(e0.elapsed_time(e1) / reps * 1e3)
        return sorted(best)[len(best) // 2]

    small = (("ptr", 4, 2, 64, 2, False), ("tma", 4, 2, 64, 2, False), ("tma", 8, 2, 64, 1, False),
             ("tma", 4, 2, 64, 1, True), ("tma", 4, 3, 64, 1, True), ("tma", 4, 2, 32, 2, True),
             ("tma", 4, 3, 32, 2, True), ("tma", 4, 4, 32, 2, True), ("tma", 8, 2, 64, 1, True))
    wide = (("ptr", 8, 2, 64, 1, False), ("tma", 8, 2, 64, 1, False), ("tma", 8, 3, 32, 1, False),
            ("tma", 8, 2, 32, 1, False), ("tma", 8, 2, 64, 1, True))
    for H, B, L in ((16, 32, 4096), (16, 64, 8192), (16, 16, 1024), (16, 1, 16384), (16, 1, 32768),
                    (128, 32, 4096), (128, 64, 8192), (64, 32, 4096), (64, 1, 16384)):
        page = 64
        BH = 16 if H <= 16 else 64
        pages_per = L // page
        pool = torch.randn(B * pages_per + 1, page, 576, device=dev, dtype=torch.bfloat16)
        bt = (torch.randperm(B * pages_per, device=dev) + 1).view(B, pages_per).to(torch.int32)
        sl = torch.full((B,), L, device=dev, dtype=torch.int32)
        q = torch.randn(B, H, 576, device=dev, dtype=torch.bfloat16)
        scale = 576 ** -0.5
        gb = B * L * 576 * 2 / 1e9
        ref = M.mla_decode_triton(q, pool, bt, sl, scale, 512)
        row = {"B": B, "L": L, "H": H}
        row["shipped_us"] = graph_time(lambda: M.mla_decode_triton(q, pool, bt, sl, scale, 512))
        flat = pool.view(-1, 576)
        for kind, warps, stages, bn, cps, swap in (small if H <= 16 else wide):
            tma = kind == "tma"
            if True:
                splits = M.choose_num_splits(B, triton.cdiv(H, BH), pages_per, page, bn, 132, cps)
                kd = TensorDescriptor.from_tensor(flat, [bn, 256]) if tma else flat
                kr = TensorDescriptor.from_tensor(flat, [bn, 64]) if tma else flat
                out = q.new_empty((B, H, 512))
                o_part, lse, sp, slse = M.split_partials(out, splits, 512)
                block_s = min(128, triton.next_power_of_2(splits))
                block_vc = max(16, min(128, 512, 8192 // block_s))

                def call():
                    stage1_tma[(triton.cdiv(H, BH), splits, B)](
                        q, kd, kr, flat, flat.stride(0), bt, sl, o_part, lse, out, scale * M._LOG2E, H, splits,
                        q.stride(0), q.stride(1), bt.stride(0), *sp, *slse, out.stride(0), out.stride(1),
                        PAGE_SIZE=page, BLOCK_H=BH, BLOCK_N=bn, HALF=256, ROPE=64, DIRECT_OUT=splits == 1, TMA=tma,
                        SWAP=swap,
                        num_warps=warps, num_stages=stages)
                    M.merge_splits(o_part, lse, out, 512, splits, sp, slse, block_s, block_vc)
                key = f"{kind}{'_swap' if swap else ''}_w{warps}_s{stages}_n{bn}"
                try:
                    call()
                    torch.cuda.synchronize()
                    err = (out.float() - ref.float()).abs().max().item()
                    row[key + "_us"] = graph_time(call)
                    row[key + "_err"] = err
                    row[key + "_splits"] = splits
                except Exception as e:  # noqa: BLE001
                    row[key + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        best = min((v, k) for k, v in row.items() if k.endswith("_us"))
        row["gbps_shipped"] = gb / row["shipped_us"] * 1e6
        row["best"] = [best[1], gb / best[0] * 1e6, 2 * B * L * H * 1088 / best[0] / 1e6]
        row["tflops_shipped"] = 2 * B * L * H * 1088 / row["shipped_us"] / 1e6
        print(json.dumps(row), flush=True)
        results.append(row)
        json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": results},
                  open(out_path, "w"), indent=1)
    json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": results},
              open(out_path, "w"), indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "gpu":
        gpu_main(sys.argv[2])
    else:
        compile_main()
