"""Which patch groups win end to end: the decision logic of `kprof apply`'s ablation (pure
functions, no torch). kprof/patching/apply.py runs the steps and switches the patches.

Design. All candidate patches are installed and verified in one eager process; from the first
timed step on, each step runs one *configuration*: every group on, every group off, or every group
on but one (leave-one-out). The configurations are interleaved in randomized blocks (each block
runs every configuration once, in a shuffled order), so drift (clocks, thermals, the allocator
settling) hits every configuration alike. The first block is a warm block and is not counted: it
is the first time the unpatched code of a group runs at full speed after verification.

Compiled scripts. When the script compiles its model, each configuration is a distinct set of
patched forwards inside the compiled frames: Dynamo guards on the forwards it inlined, so a switch
compiles that configuration once and later steps of it run from Dynamo's cache, the guards
selecting the entry. Compile time is kept out of the counted steps: WARM_BLOCKS_COMPILED warm
blocks run every configuration twice first (the first run compiles, forward and backward; CUDA
graph trees, under mode="reduce-overhead", record a graph at its second run), and a counted step
during which anything compiled all the same is not counted (`decide`'s `skip`). Each
configuration adds a cache entry per compiled frame, so kprof/patching/apply.py raises Dynamo's
recompile limit by the number of configurations for the run; a frame that hits the limit anyway
runs uncompiled, its times are not compile's, and the ablation is declined.

Groups. A group is one rule id with all its matched modules. Two rules are measured as one group
when their patches interact structurally:
  * nested: one patch's module is inside another's (a module path is a dotted prefix of the
    other's), because the outer replacement decides whether the inner module runs at all. The
    model root (path "", the fused linear + cross-entropy) is exempt: its replacement calls the
    base model as a whole, so every inner patch still runs and can be switched alone; so is a
    rule that wraps its module's own forward (`wrapping`: activation checkpointing), for the
    same reason;
  * linked: one traced rewrite (kprof/rules/fx_inline.py) that holds several rules' sites is
    one switch, so its rules are one group;
  * declared: a rule whose replacement consumes another rule's output in a way that only the
    pair was verified for lists that rule's id in `consumes` (a Rule attribute, or the
    `consumes` argument of `groups_of`).
  The fused linear + cross-entropy writes its gradient over the final norm's output
  (grad_into_hidden), yet needs no declaration: kprof's norm kernels save their input, not their
  output, for backward (kernels/rms_norm.py, kernels/layer_norm.py), as eager norms do, so either
  norm is correct under it and the two are switched and judged apart.

Significance: a sign test on paired differences. For group g, block b gives one pair,
d_b = t(b, all on but g) - t(b, all on): the time g saves with everything else on. The median of
the d_b is the measured saving; its 95% distribution-free confidence interval is
[d_(k), d_(n+1-k)] (order statistics), the largest k with P(Binomial(n, 1/2) <= k-1) <= 2.5%
(the sign test's interval for a median; it assumes nothing about the noise's shape and one
outlier block moves it by one rank only). The spread printed is the interval's half-width.
  kept       the whole interval is above 0 (significantly faster);
  dropped    the whole interval is below 0 (significantly slower: its measured cost);
  undecided  the interval holds 0 (the saving is smaller than the spread): not kept.
With n < 6 blocks no interval excludes anything at 95% (6 same-sign pairs: p = 2/64 = 0.031),
so every group is undecided.

Memory. With per-step peak memory (CUDA), the same pairing gives each group's memory saving.
Under prefer="memory" a group that costs time (or is undecided) but saves at least
MEMORY_MIN_FRACTION of the step's peak is kept, and both figures are reported.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

CONFIDENCE = 0.95
MIN_BLOCKS = 6  # the fewest blocks for which a 95% sign-test interval can exclude 0 (2/64 = 0.031)
# 95% interval [d_(6), d_(15)]. At 10 blocks it was [d_(2), d_(9)], the 2nd to 9th of ten paired
# differences: the 1B Llama's gated_mlp (1.0-2.4 ms/step saved) was kept in one H200 run and
# undecided (2.44 +- 2.47 ms) in the next, and a 1B block costs ~0.5 s (5 configs x 100 ms).
DEFAULT_BLOCKS = 20
WARM_BLOCKS = 1  # not counted: the unpatched code's first full-speed run after verification
WARM_BLOCKS_COMPILED = 2  # a compiled script: each configuration's compile, then its graphs' recording
MEMORY_MIN_FRACTION = 0.01  # a memory saving below 1% of the peak is noise in the allocator's rounding
ALL_ON, ALL_OFF = "all on", "all off"


@dataclass(frozen=True)
class Config:
    """One step's patch configuration: the named groups switched off, the rest on."""

    name: str
    off: frozenset[str]

    def on(self, groups: Sequence[str]) -> list[str]:
        return [g for g in groups if g not in self.off]


def without(group: str) -> str:
    return f"without {group}"


def configs(groups: Sequence[str]) -> list[Config]:
    """all on, all off and each group's leave-one-out (with one group, leaving it out is all off)."""
    out = [Config(ALL_ON, frozenset()), Config(ALL_OFF, frozenset(groups))]
    if len(groups) > 1:
        out += [Config(without(g), frozenset([g])) for g in groups]
    return out


def steps_needed(n_groups: int, blocks: int = DEFAULT_BLOCKS, warm: int = WARM_BLOCKS) -> int:
    return (blocks + warm) * len(configs([str(i) for i in range(n_groups)]))


def blocks_within(budget_steps: int, n_groups: int, warm: int = WARM_BLOCKS) -> int:
    """The counted blocks that fit in `budget_steps` timed steps (`warm` warm blocks included)."""
    return max(0, budget_steps // len(configs([str(i) for i in range(n_groups)])) - warm)


def schedule(groups: Sequence[str], blocks: int, seed: int = 0, warm: int = WARM_BLOCKS) -> list[Config]:
    """The configuration of each timed step: `warm` + `blocks` blocks, each a shuffled
    permutation of configs(groups). Seeded: the same plan gives the same order."""
    rng = random.Random(seed)
    out: list[Config] = []
    for _ in range(warm + blocks):
        block = configs(groups)
        rng.shuffle(block)
        out += block
    return out


# ---------------------------------------------------------------------------------------------
# Groups


def groups_of(records: Sequence[tuple[str, str, bool]],
              consumes: Mapping[str, Sequence[str]] | None = None,
              linked: Sequence[Sequence[str]] = (),
              wrapping: Sequence[str] = ()) -> list[tuple[str, ...]]:
    """Rule ids merged into groups (see the module docstring). `records`: (rule id, path,
    is_module) of each installed patch; `consumes`: rule id -> ids whose output it consumes;
    `linked`: rule ids that one switch moves together (one traced rewrite holding several
    rules: PatchReport.toggle_sets); `wrapping`: rule ids whose patch runs its module's own
    forward, exempt from nesting. Groups keep the records' rule order."""
    order = list(dict.fromkeys(r for r, _, _ in records))
    parent = {r: r for r in order}

    def find(r: str) -> str:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb, key=order.index)] = min(ra, rb, key=order.index)

    mods = [(r, p) for r, p, is_mod in records if is_mod and p and r not in wrapping]
    for i, (ra, pa) in enumerate(mods):
        for rb, pb in mods[i + 1:]:
            if ra != rb and (pa == pb or pb.startswith(pa + ".") or pa.startswith(pb + ".")):
                union(ra, rb)
    for ids in linked:
        ids = [r for r in ids if r in parent]
        for r in ids[1:]:
            union(ids[0], r)
    for r, deps in (consumes or {}).items():
        for d in deps:
            if r in parent and d in parent:
                union(r, d)
    out: dict[str, list[str]] = {}
    for r in order:
        out.setdefault(find(r), []).append(r)
    return [tuple(v) for v in out.values()]


def group_name(group: Sequence[str]) -> str:
    return "+".join(group)


# ---------------------------------------------------------------------------------------------
# Statistics


def _binom_cdf(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    return sum(math.comb(n, i) for i in range(0, k + 1)) / 2.0**n


def sign_interval(diffs: Sequence[float], level: float = CONFIDENCE) -> tuple[float, float]:
    """The sign test's distribution-free `level` confidence interval for the median of `diffs`
    ((-inf, inf) when n is too small for any)."""
    xs = sorted(diffs)
    n = len(xs)
    alpha = (1.0 - level) / 2
    k = 0
    while k + 1 <= n // 2 and _binom_cdf(k, n) <= alpha:  # P(X <= k) <= alpha: rank k+1 is a bound
        k += 1
    if k == 0:
        return -math.inf, math.inf
    return xs[k - 1], xs[n - k]


@dataclass
class Decision:
    """One group's verdict. saving_ms > 0: the step is faster with the group on."""

    group: tuple[str, ...]
    verdict: str  # kept | dropped | undecided
    saving_ms: float  # median paired saving, ms/step
    lo_ms: float  # 95% interval of the saving
    hi_ms: float
    n: int  # pairs (blocks) counted
    reason: str
    memory_saving_bytes: float | None = None  # median paired peak-memory saving (CUDA runs)

    @property
    def name(self) -> str:
        return group_name(self.group)

    @property
    def spread_ms(self) -> float:
        return (self.hi_ms - self.lo_ms) / 2 if math.isfinite(self.hi_ms - self.lo_ms) else math.inf

    @property
    def kept(self) -> bool:
        return self.verdict == "kept"


@dataclass
class Ablation:
    groups: list[tuple[str, ...]]
    decisions: list[Decision]
    total: Decision | None  # all off vs all on: what every group together saves
    blocks: int  # counted blocks with every configuration timed
    steps: int  # timed steps the ablation ran (warm block included)
    config_ms: dict[str, float] = field(default_factory=dict)  # median step time per configuration
    peak_bytes: dict[str, float] = field(default_factory=dict)  # median peak memory per configuration
    # every counted step's time per configuration, in block order: the noise itself, to read where
    # a wide interval comes from (one slow block, or a drift across the run)
    times_by_config: dict[str, list[float]] = field(default_factory=dict)
    warm_blocks: int = WARM_BLOCKS
    skipped: list[int] = field(default_factory=list)  # counted steps left out (something compiled in them)

    def decision(self, rule: str) -> Decision | None:
        return next((d for d in self.decisions if rule in d.group), None)

    @property
    def kept_rules(self) -> list[str]:
        return [r for d in self.decisions if d.kept for r in d.group]


def _fmt(ms: float) -> str:
    return f"{ms:.3g} ms" if math.isfinite(ms) else "? ms"


def _paired(values: Mapping[tuple[int, str], float], a: str, b: str, blocks: Sequence[int]) -> list[float]:
    """values[b, a] - values[b, b_] over the blocks where both configurations were measured."""
    return [values[(k, a)] - values[(k, b)] for k in blocks if (k, a) in values and (k, b) in values]


def _judge(group: tuple[str, ...], diffs: list[float], mem: list[float], peak_on: float | None,
           prefer: str) -> Decision:
    n = len(diffs)
    med = statistics.median(diffs) if diffs else math.nan
    lo, hi = sign_interval(diffs)
    msave = statistics.median(mem) if mem else None
    d = Decision(group, "undecided", med, lo, hi, n, "", msave)
    stat = f"n={n}, spread ±{_fmt(d.spread_ms)}"
    if n < MIN_BLOCKS:
        d.reason = (f"not enough blocks to decide ({n} < {MIN_BLOCKS}; a 95% sign test needs {MIN_BLOCKS}): "
                    "raise --steps")
    elif lo > 0:
        d.verdict, d.reason = "kept", f"faster by {_fmt(med)}/step ({stat})"
    elif hi < 0:
        d.verdict, d.reason = "dropped", f"slower: costs {_fmt(-med)}/step ({stat})"
    else:
        d.reason = f"saving {_fmt(med)}/step is within the spread ({stat}): not kept"
    saves_memory = (msave is not None and peak_on and msave >= MEMORY_MIN_FRACTION * peak_on)
    if d.verdict != "kept" and saves_memory:
        mib = msave / 2**20
        if prefer == "memory":
            d.verdict = "kept"
            d.reason = f"kept for memory (--prefer memory): saves {mib:.0f} MiB peak; time: {d.reason}"
        else:
            d.reason += f"; saves {mib:.0f} MiB peak memory (kept under --prefer memory)"
    return d


def decide(groups: Sequence[tuple[str, ...]], steps: Sequence[Config], times_ms: Sequence[float],
           peaks: Sequence[float | None] | None = None, *, prefer: str = "time", warm: int = WARM_BLOCKS,
           skip: Collection[int] = ()) -> Ablation:
    """Verdicts from the timed steps. `steps[i]` is the configuration step i ran (schedule() with
    the same `warm`), `times_ms[i]` its time and `peaks[i]` its peak memory in bytes (None: not
    measured). Steps past len(times_ms) did not run (the script ended early) and steps in `skip`
    are not counted (Dynamo compiled during them: compile time is not step time); blocks missing a
    configuration still count for the pairs they hold."""
    if prefer not in ("time", "memory"):
        raise ValueError(f"prefer must be 'time' or 'memory', got {prefer!r}")
    names = [group_name(g) for g in groups]
    k = len(configs(names))
    t: dict[tuple[int, str], float] = {}
    m: dict[tuple[int, str], float] = {}
    skipped = sorted(i for i in set(skip) if warm * k <= i < min(len(times_ms), len(steps)))
    left_out = set(skipped)
    for i, ms in enumerate(times_ms[: len(steps)]):
        b = i // k
        if b < warm or i in left_out:
            continue
        t[(b, steps[i].name)] = float(ms)
        if peaks is not None and i < len(peaks) and peaks[i] is not None:
            m[(b, steps[i].name)] = float(peaks[i])
    blocks = sorted({b for b, _ in t})
    full = [b for b in blocks if all((b, c.name) in t for c in configs(names))]
    on_peaks = [v for (b, c), v in m.items() if c == ALL_ON]
    peak_on = statistics.median(on_peaks) if on_peaks else None
    decisions = []
    for g, name in zip(groups, names):
        off = ALL_OFF if len(groups) == 1 else without(name)
        decisions.append(_judge(tuple(g), _paired(t, off, ALL_ON, blocks), _paired(m, off, ALL_ON, blocks),
                                peak_on, prefer))
    total = None
    if groups:
        total = _judge(tuple(r for g in groups for r in g), _paired(t, ALL_OFF, ALL_ON, blocks),
                       _paired(m, ALL_OFF, ALL_ON, blocks), peak_on, "time")
    by_conf: dict[str, list[float]] = {}
    for (_, c), v in sorted(t.items()):
        by_conf.setdefault(c, []).append(v)
    by_peak: dict[str, list[float]] = {}
    for (_, c), v in m.items():
        by_peak.setdefault(c, []).append(v)
    return Ablation(list(map(tuple, groups)), decisions, total, len(full), min(len(times_ms), len(steps)),
                    {c: statistics.median(v) for c, v in by_conf.items()},
                    {c: statistics.median(v) for c, v in by_peak.items()}, by_conf, warm, skipped)


def batch_headroom(peak_before: float, peak_after: float, static: float) -> float | None:
    """How many times larger a batch fits in the memory `peak_before` held, once the kept patches
    bring the peak to `peak_after`. Basis: the step's peak = static memory (weights, gradients,
    optimizer state: allocated between steps, `static`) + activations, and activations scale
    linearly with the batch, so (peak_before - static) / (peak_after - static). None when the
    figures don't allow it (no activation memory, or the peak did not drop)."""
    act_before, act_after = peak_before - static, peak_after - static
    if not (act_before > 0 and act_after > 0) or peak_after >= peak_before:
        return None
    return act_before / act_after
