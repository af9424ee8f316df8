"""A synthetic one-step memory record in the exact formats kprof reads: the dict
`torch.cuda.memory._snapshot()` returns (segments with blocks, device_traces with alloc /
free_requested / free_completed entries and frames) and the runner's ranges and tensors.

Planted (bytes): parameters 2 x 4096, optimizer state one 8192 block holding exp_avg and
exp_avg_sq, activations saved in layers.0 (16384) and layers.1 (32768) and one outside the
modules (1024, the loss), a temporary in each phase, gradients allocated in the backward. The
peak is right after layers.1's gradient is allocated, inside layers.1's backward node."""

MiB = 1 << 20
P1, P2, S1 = 0x10000000, 0x10002000, 0x20000000
G1, G2 = 0x30000000, 0x30002000
ACT0, TMP0, ACT1, OUT, BTMP, OTMP = 0x40000000, 0x41000000, 0x42000000, 0x43000000, 0x44000000, 0x45000000
FRAME = [{"filename": "train.py", "line": 12, "name": "forward"}]

# (time_us, action, addr, size)
EVENTS = [
    (1050, "alloc", ACT0, 16384),
    (1060, "alloc", TMP0, 2048),
    (1070, "free", TMP0, 2048),
    (1250, "alloc", ACT1, 32768),
    (1450, "alloc", OUT, 1024),
    (1510, "alloc", BTMP, 8192),
    (1520, "alloc", G2, 4096),
    (1550, "free", ACT1, 32768),
    (1560, "free", BTMP, 8192),
    (1610, "alloc", G1, 4096),
    (1620, "free", ACT0, 16384),
    (1630, "free", OUT, 1024),
    (1810, "alloc", OTMP, 512),
    (1820, "free", OTMP, 512),
]
PLANTED_PEAK = {"parameters": 8192, "gradients": 4096, "optimizer state": 8192,
                "activations": 16384 + 32768 + 1024, "temporaries": 8192, "other (before the step)": 0}
PEAK = sum(PLANTED_PEAK.values())
RESERVED = 26 * MiB


def snapshot() -> dict:
    trace = []
    for t, action, addr, size in EVENTS:
        if action == "alloc":
            trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": FRAME})
        else:  # the allocator logs a request, then the completed free
            for a in ("free_requested", "free_completed"):
                trace.append({"action": a, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": FRAME})

    def seg(addr, total, live):
        blocks = [{"address": a, "size": s, "requested_size": s, "state": "active_allocated", "frames": FRAME}
                  for a, s in live]
        used = sum(s for _, s in live)
        blocks.append({"address": addr + used, "size": total - used, "requested_size": 0, "state": "inactive",
                       "frames": []})
        return {"device": 0, "address": addr, "total_size": total, "stream": 0, "segment_type": "large",
                "segment_pool_id": (0, 0), "allocated_size": used, "active_size": used, "blocks": blocks}

    return {"segments": [seg(P1, 2 * MiB, [(P1, 4096), (P2, 4096)]), seg(S1, 2 * MiB, [(S1, 8192)]),
                         seg(G1, 2 * MiB, [(G1, 4096), (G2, 4096)]), seg(ACT0, 20 * MiB, [])],
            "device_traces": [trace]}


def ranges() -> list:
    """[name, t0, t1, tid, seq] as the runner records them."""
    return [
        ["kprof.shapes_step#0", 1000, 2000, 1, -1],
        ["kprof.module::Net", 1000, 1400, 1, -1],
        ["kprof.module:layers.0:Block", 1010, 1200, 1, -1],
        ["kprof.module:layers.1:Block", 1200, 1390, 1, -1],
        ["autograd::engine::evaluate_function: MmBackward0", 1500, 1600, 2, 7],
        ["autograd::engine::evaluate_function: MmBackward0", 1600, 1700, 2, 3],
        ["Optimizer.step#AdamW.step", 1800, 1900, 1, -1],
    ]


FORWARD_OPS = [[1055, 3, 1], [1260, 7, 1]]  # [t_us, seq, tid]: the ops that made the backward nodes


def tensors(grads_at_start: bool = False) -> dict:
    params = [[P1, 4096, "w1", "float32"], [P2, 4096, "w2", "float32"]]
    state = [[S1, 4096, "w1.exp_avg", "float32"], [S1 + 4096, 4096, "w1.exp_avg_sq", "float32"]]
    grads = [[G1, 4096, "w1.grad", "float32"], [G2, 4096, "w2.grad", "float32"]]
    return {"at_forward_start": {"parameters": params, "optimizer_state": state,
                                 "gradients": grads if grads_at_start else []},
            "at_step_end": {"parameters": params, "optimizer_state": state, "gradients": grads}}


def profiler_record(pre_window: int = 16384) -> dict:
    """The same step as the runner's profiler record: +/- bytes with Total Allocated after each
    event (the 16 KiB of parameters and state were allocated before the window)."""
    total, events = pre_window, []
    for t, action, addr, size in EVENTS:
        b = size if action == "alloc" else -size
        total += b
        events.append([t, addr, b, total, RESERVED])
    return {"source": "profiler", "device": "cuda", "events": events, "ranges": ranges(),
            "forward_ops": FORWARD_OPS, "tensors": tensors(), "cuda": {"max_allocated": PEAK}}
