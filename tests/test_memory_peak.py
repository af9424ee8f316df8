"""benchmarks/memory_peak.py: the replay of the allocator's trace (pure; the GPU part is only the
recording), on a synthetic trace shaped like torch.cuda.memory._snapshot()'s."""

from benchmarks.memory_peak import by_site, live_at_peak, site


def _f(file, line, name="f"):
    return {"filename": file, "line": line, "name": name}


TORCH = "/venv/lib/python3.12/site-packages/torch/nn/functional.py"


def _trace():
    a = [_f(TORCH, 10), _f("/repo/kernels/rms_norm.py", 5, "_launch_bwd"), _f("/repo/train.py", 3)]
    b = [_f("/repo/kernels/fused_linear_cross_entropy.py", 9, "_lce_launch")]
    return [
        {"action": "alloc", "addr": 1, "size": 100, "frames": a},
        {"action": "alloc", "addr": 2, "size": 50, "frames": b},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},  # counted once, at the request
        {"action": "alloc", "addr": 3, "size": 120, "frames": b},  # total 170: the peak
        {"action": "segment_alloc", "addr": 9, "size": 4096},  # the allocator's own, not a tensor
        {"action": "free_completed", "addr": 3, "size": 120},
        {"action": "alloc", "addr": 4, "size": 110, "frames": a},  # 160 < 170
    ]


def test_peak_and_the_blocks_alive_then():
    peak, live = live_at_peak(_trace())
    assert peak == 170 and sorted(b["addr"] for b in live) == [2, 3]


def test_site_skips_torch_frames_and_groups_by_caller():
    assert site(_trace()[0]["frames"]) == "/repo/kernels/rms_norm.py:5 (_launch_bwd)"
    assert site([_f(TORCH, 1)]) == "<torch internal>"
    rows = by_site(live_at_peak(_trace())[1])
    assert rows == [{"site": "/repo/kernels/fused_linear_cross_entropy.py:9 (_lce_launch)", "bytes": 170, "blocks": 2}]


def test_site_skips_cpp_frames():
    # What stacks="all" recorded on the H200 (2026-11-29): C++ frames first, with filename "??".
    frames = [_f("??", 0, "torch::unwind::unwind()"), _f("??", 0, "c10::cuda::CUDACachingAllocator"),
              _f("/repo/kernels/rms_norm.py", 5, "_launch_bwd")]
    assert site(frames) == "/repo/kernels/rms_norm.py:5 (_launch_bwd)"
    assert site(frames[:2]) == "<torch internal>"
