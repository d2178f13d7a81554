"""``fuse()`` from several threads at once: every model fuses fully and equals native, and the process is left
as it was (a later single-threaded ``fuse`` is unaffected).

fx tracing patches ``nn.Module.__call__`` and module globals process-wide while it runs; two traces that
interleave leave each other's patches behind, and per-process match caches keyed by class and shape would then
remember the failures.  Fusion is serialised by one process-wide lock, so this test must see every model fused."""

import threading

import torch

import mla_fuser
from mla_fuser.fusers.base import Fuser

from conftest import tiny_deepseek


def _build_and_fuse(arch, seed, results, errors):
    try:
        model = tiny_deepseek(arch, attn="vllm_mla", seed=seed)
        report = mla_fuser.fuse(model)
        results.append((arch, seed, model, report))
    except Exception as exc:  # pragma: no cover - the assertion below reports it
        errors.append(f"{arch}/{seed}: {type(exc).__name__}: {exc}")


def _fully_fused(report) -> bool:
    return bool(report.fused("mla")) and not report.fallbacks() and bool(report.fused("moe")) \
        and bool(report.fused("norm"))


def test_two_threads_fusing_at_once_fuse_fully_and_equal_native():
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    for round_ in range(3):
        Fuser.cache_clear()  # every round traces afresh, so the threads really trace at the same time
        results, errors = [], []
        threads = [threading.Thread(target=_build_and_fuse, args=(arch, round_ * 10 + i, results, errors))
                   for i, arch in enumerate(["deepseek_v2", "deepseek_v3", "deepseek_v2", "deepseek_v3"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        assert len(results) == len(threads)
        for arch, seed, model, report in results:
            assert _fully_fused(report), f"{arch}/{seed}:\n{report}"
            # (threads draw from one global RNG while building: the reference takes the fused model's weights)
            native = tiny_deepseek(arch, seed=seed)
            native.load_state_dict(model.state_dict())
            with torch.no_grad():
                torch.testing.assert_close(model(ids).logits, native(ids).logits, atol=1e-4, rtol=1e-4)
    # the process is unaffected: a later fuse in this thread still fuses everything and computes right
    Fuser.cache_clear()
    model = tiny_deepseek("deepseek_v2", attn="vllm_mla", seed=99)
    report = mla_fuser.fuse(model)
    assert _fully_fused(report), str(report)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tiny_deepseek("deepseek_v2", seed=99)(ids).logits,
                                   atol=1e-4, rtol=1e-4)
    assert torch.nn.Module.__call__ is torch.nn.Module.__dict__["__call__"]
