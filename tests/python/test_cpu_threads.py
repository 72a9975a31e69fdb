"""CPU calls run their tasks on torch's own intra-op threads (src/cpu/parallel.hpp's executor,
installed by the PyTorch operator library python/src/torch_ops.cpp in itself and in tileattn._ext),
not on a second pool competing with torch's for the same cores: such a call starts no thread of its
own, and its results are bitwise those of a one-thread call and of tileattn's own pool, at any
torch thread count and from several Python threads at once."""

import ctypes

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import naive
import tileattn
from tileattn import _ops

_LIBRARY_BUILT = any(name.startswith("_torch_ops.") for name in os.listdir(os.path.dirname(_ops.__file__)))
needs_library = pytest.mark.skipif(not _LIBRARY_BUILT,
                                   reason="the package was built without the PyTorch operator library")


@needs_library
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_cpu_calls_start_no_threads_of_their_own():
    """Once torch's pool exists, forward and backward at 3 threads add no thread to the process
    (tileattn's own pool would add 2 helpers)."""
    script = textwrap.dedent("""
        import os, torch, tileattn
        from tileattn import _ops
        assert _ops._torch_ops is not None
        torch.set_num_threads(3)
        threads = lambda: len(os.listdir("/proc/self/task"))
        x = torch.randn(1 << 22)
        x + x  # a parallel region: torch's workers start
        q = torch.randn(1, 512, 4, 64, requires_grad=True)
        ref = torch.nn.functional.scaled_dot_product_attention(*(q.transpose(1, 2),) * 3)
        ref.sum().backward()  # anything autograd starts, started by torch's own call
        before = threads()
        out = tileattn.flash_attn_func(q, q, q, causal=True)
        out.sum().backward()
        tileattn.softmax_matmul(torch.randn(4, 512, 512), torch.randn(4, 512, 64))  # through tileattn._ext
        print(before, threads())
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = (int(n) for n in result.stdout.split())
    assert after == before, f"tileattn's calls started {after - before} threads beside torch's {before}"


def _inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    # Causal GQA with a window: uneven tasks; 2 sequences x 2 kv heads keep both backward schedules
    # in play across the thread counts below.
    q = torch.randn(2, 300, 4, 32, generator=gen)
    k, v = (torch.randn(2, 333, 2, 32, generator=gen) for _ in range(2))
    do = torch.randn(2, 300, 4, 32, generator=gen)
    return q, k, v, do


def _run(q, k, v, do):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = tileattn.flash_attn_func(q, k, v, causal=True, window_size=(200, 0))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    return [t.detach() for t in (out, dq, dk, dv)]


def _assert_bitwise(a, b, what):
    for x, y, name in zip(a, b, ("out", "dq", "dk", "dv")):
        assert torch.equal(x, y), f"{what}: {name} differs (max {(x - y).abs().max().item():.3g})"


@needs_library
def test_bitwise_across_torch_threads_callers_and_pools(monkeypatch):
    q, k, v, do = _inputs(int.from_bytes(os.urandom(4), "little"))
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(q, k, v, do)
        # The one-thread result is right, not merely repeatable: the float64 oracle's, within
        # twice a naive fp32 implementation's error.
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        exact, _ = naive.attention(qd, kd, vd, causal=True, window=(200, 0))
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        fp32, _ = naive.attention(qf, kf, vf, causal=True, window=(200, 0))
        exact_grads = torch.autograd.grad(exact, (qd, kd, vd), do.double())
        fp32_grads = torch.autograd.grad(fp32, (qf, kf, vf), do)
        for ours, same, oracle, name in zip(one, [fp32, *fp32_grads], [exact, *exact_grads], ("out", "dq", "dk", "dv")):
            naive.assert_2x_rule(ours, same, oracle, 1e-6, name)

        for threads in (2, 3):
            torch.set_num_threads(threads)
            _assert_bitwise(_run(q, k, v, do), one, f"{threads} torch threads")

        torch.set_num_threads(2)
        results, errors = [None] * 3, []

        def caller(i):
            try:
                for _ in range(3):
                    results[i] = _run(q, k, v, do)
            except Exception as e:  # reported on the main thread
                errors.append(e)

        callers = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
        assert not errors, errors
        for i, r in enumerate(results):
            _assert_bitwise(r, one, f"Python thread {i}")

        # The Python route (tileattn._ext's calls) on torch's threads, then on _ext's own pool.
        executor = _ops._torch_ops.cpu_executor
        monkeypatch.setattr(_ops, "_torch_ops", None)
        _assert_bitwise(_run(q, k, v, do), one, "the Python route on torch's threads")
        _ops._ext.set_cpu_executor(None)
        try:
            _assert_bitwise(_run(q, k, v, do), one, "tileattn's own pool")
        finally:
            _ops._ext.set_cpu_executor(executor)
    finally:
        torch.set_num_threads(saved)


def test_set_cpu_executor_takes_only_the_libraries_capsule():
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    with pytest.raises(TypeError, match="executor is a capsule named 'other', not 'tileattn.cpu_executor'"):
        _ops._ext.set_cpu_executor(new_capsule(1, b"other", None))
