"""The rule engine: rules are data, matched over a live model (structure, then a behaviour probe)
and over a profile's op table (evidence for `kprof suggest`).

Two phases, as in gpt-fast's quantizer: `find_matches` plans (which rule fits which module, with
the parameters its probe found: eps, offset, activation), `Patch.install` converts (instance-level
overrides that reuse the module's own Parameters). Nothing is replaced by class name: a module is
a candidate because of its shape (a 1-D weight and an eps, three Linears and an activation) and is
matched only if its forward, run on a small random input, computes what the kernel computes.

Order of `RULES` is precedence: an object already overridden by an earlier rule's match is not
touched by a later one.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn as nn

from kprof.analyze.modules import MATMUL_OPS, SKIP_MODULES, hits, op_base, with_descendants
from kprof.errors import KprofError

# ---------------------------------------------------------------------------------------------
# Kernels, resolved lazily: a rule names "module:function" in kprof.kernels; it is apply-able only
# when that kernel exists in this install (suggest still reports it from the profile).


def kernel_fn(ref: str) -> Callable | None:
    """`"rms_norm:rms_norm"` -> kprof.kernels.rms_norm.rms_norm, or None if not shipped."""
    mod_name, _, fn_name = ref.partition(":")
    full = f"kprof.kernels.{mod_name}"
    try:
        mod = importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name == full:
            return None
        raise
    return getattr(mod, fn_name, None)


def kernel_spec(ref: str):
    """The registry's KernelSpec whose public function (or reference) is `ref`, or None."""
    fn = kernel_fn(ref)
    if fn is None:
        return None
    from kprof.kernels.registry import REGISTRY

    for spec in REGISTRY.values():
        if spec.fn is fn or spec.reference is fn:
            return spec
    return None


def reference_fn(ref: str) -> Callable | None:
    """The pure-PyTorch reference beside a kernel: `rms_norm:rms_norm` -> `rms_norm_reference`."""
    mod_name, _, fn_name = ref.partition(":")
    return kernel_fn(f"{mod_name}:{fn_name}_reference")


# ---------------------------------------------------------------------------------------------
# Rules


@dataclass(frozen=True)
class ProfilePattern:
    """How a rule's pattern shows in ops.parquet (suggest's side; no model needed).

    Op names are matched without the `aten::` prefix, on forward-phase ops. A module path
    qualifies if the ops attributed to the module itself ("own") contain every name in `own_all`,
    at least one of `own_any` (when given) and none of `own_none`; the own ops of its direct
    children contain at least one of `child_any` (when given); at least `child_linear` direct
    children run a matmul (mm/addmm/linear/matmul/bmm), and at most `child_linear_max`; and
    `root_only` keeps top-level modules.

    `evidence` selects the ops whose device time (forward, and backward where the profile
    attributes it to the module) the replacement removes:
    "*" every op in the subtree; "own:NAME" the module's own ops named NAME; "childmod:NAME" every
    op of each direct child whose own ops include NAME; "subtree:NAME" ops named NAME anywhere
    in the subtree.
    """

    own_all: tuple[str, ...] = ()
    own_any: tuple[str, ...] = ()
    own_none: tuple[str, ...] = ()
    child_any: tuple[str, ...] = ()
    child_linear: int = 0
    child_linear_max: int | None = None  # at most this many matmul children (None: no limit)
    root_only: bool = False
    evidence: tuple[str, ...] = ("*",)


@dataclass(frozen=True)
class Rule:
    """One pattern -> one fix. See the rule modules for instances; `examples/custom_rules/` for a
    user rule loaded with `--rules DIR`."""

    id: str  # stable id used by `--patch ID`
    title: str  # one line, what the user reads
    kernels: tuple[str, ...]  # "module:function" in kprof.kernels, all needed to apply
    # Live side. `match(path, module)` -> params dict if the module is this pattern (structure
    # checked first, then a behaviour probe), else None.
    match: Callable[[str, nn.Module], dict | None] | None
    # `replace(module, params)` -> {relative child path ("" = the module): new forward}.
    replace: Callable[[nn.Module, dict], dict[str, Callable]] | None
    profile: ProfilePattern
    # Kernel problem for the saving estimate from the evidence ops of one matched module
    # (a DataFrame slice of ops.parquet) -> kwargs for `KernelSpec.cost`, or None if unknown.
    problem: Callable[[Any], dict | None] | None = None
    # Cost of the replacement when it is not a kprof kernel (e.g. SDPA): cost(**problem) ->
    # {"fwd": Cost, "bwd": Cost}. Default: the first kernel's KernelSpec.cost.
    cost: Callable[..., Mapping[str, Any]] | None = None
    tensor_core: bool = False  # the replacement's FLOPs run at the matmul peak (attention, LCE)
    change: str = ""  # what replaces the pattern, in words ("kprof rms_norm kernel")
    code_change: str | None = None  # for rules apply can't do: the edit the user makes
    confidence: str = "high"  # how sure a profile-side match is the pattern: high|medium|low
    # Which outputs verification compares (default: every floating tensor in the output).
    outputs: Callable[[Any], Any] | None = None
    # A check of the unit's internals beside its outputs and grads, at each verification on the
    # real input: `check(module, params, args, kwargs)` -> (ok, what) or None (nothing to check).
    # Calls of the module inside it run the original code (the MoE rule compares routings).
    check: Callable[[nn.Module, dict, tuple, dict], tuple[bool, str] | None] | None = None
    # Namespace-level rules (a function in a model's Python module, e.g. apply_rotary_pos_emb)
    # find their own targets: `find(model)` -> [(path, namespace, attr, params)].
    find: Callable[[nn.Module], list[tuple[str, Any, str, dict]]] | None = None
    replace_fn: Callable[[Callable, dict], Callable] | None = None
    # Traced rules (rules/fx_inline.py) match on the graph of a module's own forward, traced at
    # its first real call: `sites(traced, module)` -> ([Site], [reason a site was declined]).
    # `hints`: op names one of which the forward's source must mention to be traced at all (a
    # cheap filter on the code's operations, not on names the user chose).
    sites: Callable[[Any, nn.Module], tuple[list, list[str]]] | None = None
    hints: tuple[str, ...] = ()
    # The replacement runs the module's own forward around (activation checkpointing): the code
    # inside it, kprof's patches included, still runs, so those are not "replaced" and the
    # ablation switches them apart (kprof/patching/ablation.py groups_of).
    wraps: bool = False
    source: str = "builtin"  # or the file a user rule came from

    @property
    def applyable(self) -> bool:
        live = self.replace is not None or self.replace_fn is not None or self.sites is not None
        return live and self.kernels_available

    @property
    def kernels_available(self) -> bool:
        return all(kernel_fn(k) is not None for k in self.kernels)

    def missing_kernels(self) -> list[str]:
        return [k for k in self.kernels if kernel_fn(k) is None]


@dataclass
class Match:
    """A rule's planned hit on a live model (phase one)."""

    rule: Rule
    path: str  # module path ("model.layers.0.mlp") or "module.function" for namespace rules
    target: Any  # the nn.Module, or the Python module holding the function
    params: dict
    attr: str = "forward"  # the entry attribute patched on target
    source: str = ""  # file:line of the matched code

    @property
    def is_module(self) -> bool:
        return isinstance(self.target, nn.Module)

    @property
    def deferred(self) -> bool:
        """Matched at the first real call, on the traced graph (params["traced"]: the rules)."""
        return "traced" in self.params


# ---------------------------------------------------------------------------------------------
# Finding matches


def source_of(obj: Any) -> str:
    """file:line of a module's forward (or a function), for the user to find the matched code."""
    fn = obj
    if isinstance(obj, nn.Module):
        fn = type(obj).forward
    fn = inspect.unwrap(fn)
    try:
        file = inspect.getsourcefile(fn) or "?"
        line = inspect.getsourcelines(fn)[1]
    except (OSError, TypeError):
        return "?"
    return f"{file}:{line}"


def forward_source(m: nn.Module) -> str:
    try:
        return inspect.getsource(type(m).forward)
    except (OSError, TypeError):
        return ""


def code_text(m: nn.Module) -> str:
    """The source a module's forward runs itself: its forward, the plain functions of its module
    it calls by name (a `rmsnorm(x, w, eps)` helper), and the forwards of its parameter-free leaf
    children (an activation module whose forward is `F.silu`)."""
    fwd = inspect.unwrap(type(m).forward)
    parts = [forward_source(m)]
    glb = getattr(fwd, "__globals__", {})
    for name in getattr(getattr(fwd, "__code__", None), "co_names", ()):
        f = glb.get(name)
        if inspect.isfunction(f):
            try:
                parts.append(inspect.getsource(f))
            except (OSError, TypeError):
                pass
    parts += [forward_source(c) for c in m.children()  # parameter-free leaves only: activations
              if not any(True for _ in c.parameters()) and not any(True for _ in c.children())]
    return "\n".join(parts)


def find_matches(model: nn.Module, rules: Sequence[Rule]) -> list[Match]:
    """Plan: every (rule, target) that fits, in rule order, at most one rule per overridden object.

    Traced rules plan a candidate per module whose forward mentions one of their ops; all the
    traced rules that want one module share one Match (one rewrite of that forward), resolved
    at its first call."""
    claimed: set[tuple[int, str]] = set()
    out: list[Match] = []
    traced: dict[int, Match] = {}
    replaced: set[int] = set()  # modules inside a forward replaced whole: their code no longer runs
    for rule in rules:
        if not rule.applyable:
            continue
        if rule.sites is not None:
            for path, mod in model.named_modules():
                if id(mod) in traced:
                    if rule not in traced[id(mod)].params["traced"]:
                        traced[id(mod)].params["traced"].append(rule)
                    continue
                if (id(mod), "forward") in claimed or "forward" in mod.__dict__ or id(mod) in replaced:
                    continue
                if type(mod).__module__.startswith("torch.nn.") and not any(True for _ in mod.children()):
                    continue  # torch's own leaf modules: their forward is one aten call
                if not any(h in code_text(mod) for h in rule.hints):
                    continue
                params = {"traced": [rule]}
                kinds = {p.kind for p in inspect.signature(type(mod).forward).parameters.values()}
                if kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
                    # known before any call: reported as declined, the module-level rules go on
                    params["untraceable"] = ("forward takes *args/**kwargs, which the graph trace can't bind; "
                                             "module-level rules only for this module")
                else:
                    claimed.add((id(mod), "forward"))
                traced[id(mod)] = Match(rule, path, mod, params, source=source_of(mod))
                out.append(traced[id(mod)])
            continue
        if rule.find is not None:
            for path, ns, attr, params in rule.find(model):
                key = (id(ns), attr)
                if key in claimed:
                    continue
                claimed.add(key)
                out.append(Match(rule, path, ns, params, attr=attr, source=source_of(getattr(ns, attr))))
            continue
        for path, mod in model.named_modules():
            if (id(mod), "forward") in claimed or "forward" in mod.__dict__:
                continue  # already patched by an earlier rule (or by the user)
            params = rule.match(path, mod)
            if params is None:
                continue
            children = dict(mod.named_modules())
            keys = {(id(mod), "forward")}  # the entry: its first call is where the patch verifies
            rels = list(rule.replace(mod, params))
            for rel in rels:
                keys.add((id(children[rel]), "forward"))
            if keys & claimed:
                continue
            claimed |= keys
            if "" in rels and not rule.wraps:
                replaced |= {id(c) for c in mod.modules() if c is not mod}
            out.append(Match(rule, path, mod, params, source=source_of(mod)))
    return out


# ---------------------------------------------------------------------------------------------
# Probing helpers used by rule matchers


def param_like(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    for p in module.parameters():
        return p.device, p.dtype
    return torch.device("cpu"), torch.float32


def probe_input(shape: Sequence[int], device, dtype, *, seed: int = 0) -> torch.Tensor:
    """A random input with a non-zero mean: a LayerNorm and an RMSNorm agree on zero-mean rows, so
    the probe must not be zero-mean. Seeded so a probe is reproducible and leaves global RNG alone."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=g) + 0.5).to(device=device, dtype=dtype)


@contextlib.contextmanager
def probe_mode():
    """No grad and autocast off: a probe checks what a module computes at its parameters' dtype.
    Patches are installed at the root's first call, inside the script's autocast; there the
    module's matmuls run in bf16 while the candidate's reference may not, and the probe failed a
    correct match (GPT example under bf16 autocast, 2026-11-29: attention and Linear -> GELU were
    left unpatched)."""
    with contextlib.ExitStack() as st:
        st.enter_context(torch.no_grad())
        for dev in ("cuda", "cpu"):
            if torch.is_autocast_enabled(dev):
                st.enter_context(torch.autocast(dev, enabled=False))
        yield


def probe_error(fn_a: Callable[[], Any], fn_b: Callable[[], Any]) -> float:
    """Relative-norm error ||a - b|| / ||b|| (fp64) of two zero-argument callables run without
    grad; inf when either raises or they don't return same-shaped tensors."""
    try:
        with probe_mode():
            a, b = fn_a(), fn_b()
    except Exception:  # a probe that can't even run is a non-match, not an error  # noqa: BLE001
        return float("inf")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return float("inf")
    a, b = a.double(), b.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return 0.0 if torch.equal(a.nan_to_num(), b.nan_to_num()) else float("inf")
    den = b.norm()
    return float((a - b).norm() / den) if den > 0 else float((a - b).norm())


def behaves_like(fn_a: Callable[[], Any], fn_b: Callable[[], Any], dtype: torch.dtype) -> bool:
    """Run two zero-argument callables without grad and compare their tensor outputs at the
    verification tolerance of `dtype`: elementwise (allclose) and by relative norm. The second
    keeps the check meaningful when the outputs are small against the table's atol (a bf16 MLP at
    HF's init, std 0.02, outputs ~1e-3: under atol 1e-2 alone a SiLU MLP passed for Gemma's
    GELU-tanh one). Exceptions mean "not this pattern"."""
    from kprof.kernels.common import TOLERANCE

    tol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    try:
        with probe_mode():
            a, b = fn_a(), fn_b()
    except Exception:  # a probe that can't even run is a non-match, not an error  # noqa: BLE001
        return False
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return False
    if not torch.allclose(a.float(), b.float(), atol=tol.atol, rtol=tol.rtol):
        return False
    return probe_error(lambda: a, lambda: b) <= tol.rtol


def closest(reference: Callable[[], Any], candidates: Mapping[Any, Callable[[], Any]], dtype: torch.dtype):
    """The key of the candidate that `behaves_like` the reference with the smallest probe error,
    or None. In bf16 several variants pass the tolerance (GELU erf vs tanh differ by ~1e-3); the
    module's own computation is reproduced exactly (error ~0) only by the right one."""
    best, best_err = None, float("inf")
    for key, fn in candidates.items():
        if behaves_like(reference, fn, dtype):
            e = probe_error(reference, fn)
            if e < best_err:
                best, best_err = key, e
    return best


def eps_of(module: nn.Module) -> float | None:
    for name in ("eps", "variance_epsilon", "epsilon"):
        v = getattr(module, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear)


# ---------------------------------------------------------------------------------------------
# User rules from a folder


def load_rules(directory: str | Path) -> list[Rule]:
    """Import every `*.py` in `directory` and collect its `RULE` (one) or `RULES` (a list)."""
    d = Path(directory)
    if not d.is_dir():
        raise KprofError(f"--rules {directory}: not a directory; pass a folder of rule files (see examples/custom_rules/)")
    found: list[Rule] = []
    for f in sorted(d.glob("*.py")):
        if f.name.startswith("_"):
            continue
        name = f"kprof_user_rules.{f.stem}"
        spec = importlib.util.spec_from_file_location(name, f)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception as e:
            raise KprofError(f"--rules: importing {f} failed: {type(e).__name__}: {e}") from e
        rules = list(getattr(mod, "RULES", [])) + ([mod.RULE] if hasattr(mod, "RULE") else [])
        if not rules:
            raise KprofError(f"--rules: {f} defines neither RULE nor RULES; see examples/custom_rules/")
        for r in rules:
            if not isinstance(r, Rule):
                raise KprofError(f"--rules: {f}: {r!r} is not a kprof.rules.Rule")
            found.append(_with_source(r, str(f)))
    if not found:
        raise KprofError(f"--rules {directory}: no rule files (*.py) found")
    return found


def _with_source(rule: Rule, source: str) -> Rule:
    from dataclasses import replace

    return replace(rule, source=source)


def select(rules: Sequence[Rule], ids: Iterable[str] | None) -> list[Rule]:
    """The rules with the given ids, in precedence order; unknown ids are an error."""
    if ids is None:
        return list(rules)
    ids = list(ids)
    by_id = {r.id: r for r in rules}
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        raise KprofError(f"unknown rule id(s) {', '.join(unknown)}; known: {', '.join(by_id)}")
    return [r for r in rules if r.id in set(ids)]


def match_pattern(pattern, table: pd.DataFrame) -> list[str]:
    """Module paths whose recorded ops fit a rule's ProfilePattern (see rules/engine.py)."""
    def has(names: frozenset, wanted) -> list[bool]:
        return [any(n == w or n.startswith(w + "_") for n in names) for w in wanted]

    out = []
    for path, own, children in zip(table["module"], table["own"], table["children"]):
        if pattern.root_only and path != "":
            continue
        if not all(has(own, pattern.own_all)):
            continue
        if pattern.own_any and not any(has(own, pattern.own_any)):
            continue
        if any(has(own, pattern.own_none)):
            continue
        kid_own = [table.at[c, "own"] for c in children]
        if pattern.child_any and not any(any(has(k, pattern.child_any)) for k in kid_own):
            continue
        n_mm = sum(any(has(k, MATMUL_OPS)) for k in kid_own)
        if n_mm < pattern.child_linear or (pattern.child_linear_max is not None and n_mm > pattern.child_linear_max):
            continue
        out.append(path)
    return out


def evidence_ops(pattern, ops: pd.DataFrame, table: pd.DataFrame, path: str) -> pd.DataFrame:
    """The ops (all steps, fwd and bwd) a rule's replacement removes at one module path."""
    mod = ops["module"]
    in_subtree = (mod == path) | mod.str.startswith(path + ".") if path else ~mod.isin(SKIP_MODULES)
    sub = ops[in_subtree & ops["phase"].isin(["fwd", "bwd"])]
    names = op_base(sub["op"])
    sel = np.zeros(len(sub), dtype=bool)
    for item in pattern.evidence:
        kind, _, name = item.partition(":") if ":" in item else ("*", "", "")
        if kind == "*":
            sel[:] = True
        elif kind == "own":
            sel |= ((sub["module"] == path) & hits(names, [name])).to_numpy()
        elif kind == "subtree":
            sel |= hits(names, [name]).to_numpy()
        elif kind == "childmod":
            kids = [c for c in table.at[path, "children"]
                    if any(n == name or n.startswith(name + "_") for n in table.at[c, "own"])]
            sel |= sub["module"].isin(kids).to_numpy()
    return sub[with_descendants(sub, sel)]
