"""Activation checkpointing of the repeated blocks -> less activation memory, one more forward.

A memory rule (issue 28): it makes the step slower, so it is installed only when named
(`kprof apply --patch activation_checkpointing`, `kprof.patch(model, rules=[...])`), never by
`rules="all"`; `kprof apply --prefer memory` keeps it when it lowers the peak.

Structure: the blocks of a repeated stack, the items of a ModuleList or Sequential (a path that
ends in an index, as the memory analysis's layers do: rules/diagnoses/memory.py) that have
children and parameters, outermost only (an expert list inside a layer is not a second level).
`checkpoint_rule(paths)` names the modules instead (the diagnosis's ranking, or the user's).

The replacement is the module's own forward under torch.utils.checkpoint (use_reentrant=False,
preserve_rng_state=True): the backward recomputes it from the block's inputs with the forward's
RNG state restored, so dropout masks are the same and the patched forward + backward equals the
original (verified like every patch, weight gradients included). The inner modules' code, and
kprof's patches on them, still run: the ablation switches them apart (`Rule.wraps`).

Arguments that are neither tensors nor plain values (a Hugging Face KV cache) are passed to the
forward as they are. One the forward changed (the cache it appended to) is passed as None to the
recompute: a second call would write it again and read what the first wrote (HF's own
checkpointing drops the cache the same way). Verification runs the recompute at the first call;
a recompute that depended on it fails there (reverted), or raises torch's CheckpointError.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Iterable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils.checkpoint import checkpoint

from kprof.errors import KprofError
from kprof.rules.engine import ProfilePattern, Rule

ID = "activation_checkpointing"
_INDEX = re.compile(r"(^|\.)\d+$")
_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, type(None))
_FINGERPRINT_DEPTH = 6  # a cache object -> its list of layers -> a layer -> its tensors
_FINGERPRINT_ITEMS = 4096  # an argument holding a whole model is not walked past this


def is_repeated_block(path: str, m: nn.Module) -> bool:
    """An item of a ModuleList/Sequential with children and parameters, no such item above it."""
    if not _INDEX.search(path) or not any(True for _ in m.children()):
        return False
    if not any(True for _ in m.parameters()):
        return False
    parts = path.split(".")
    return not any(p.isdigit() for p in parts[:-1])


def _leaf(x: Any) -> bool:
    return type(x) not in (tuple, list, dict)


def _fingerprint(obj: Any) -> list:
    """What a call can change in an object argument: the tensors it reaches (identity, shape,
    in-place version) and the lengths of its lists and dicts, a few attributes deep."""
    out: list = []

    def walk(x, depth):
        if len(out) > _FINGERPRINT_ITEMS:
            return
        if isinstance(x, torch.Tensor):
            out.append((id(x), tuple(x.shape), x._version))
        elif depth <= 0 or isinstance(x, (type, nn.Module) + _PLAIN):
            return
        elif isinstance(x, (list, tuple)):
            out.append(len(x))
            for y in x:
                walk(y, depth - 1)
        elif isinstance(x, dict):
            out.append(len(x))
            for y in x.values():
                walk(y, depth - 1)
        elif hasattr(x, "__dict__"):
            walk(vars(x), depth - 1)

    walk(obj, _FINGERPRINT_DEPTH)
    return out


def checkpointed(fwd):
    """`fwd` (a bound forward) run under a non-reentrant checkpoint when grad is on."""

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # no backward, nothing saved: checkpointing saves nothing
            return fwd(*args, **kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs), is_leaf=_leaf)
        tix = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        objs = [i for i, v in enumerate(flat) if not isinstance(v, (torch.Tensor,) + _PLAIN)]
        before = {i: _fingerprint(flat[i]) for i in objs}
        changed: list[int] = []
        calls = [0]

        def run(*tensors):
            vals = list(flat)
            for i, t in zip(tix, tensors):
                vals[i] = t
            for i in changed if calls[0] else ():
                vals[i] = None  # the recompute: see the module docstring
            calls[0] += 1
            a, kw = pytree.tree_unflatten(vals, spec)
            return fwd(*a, **kw)

        # Every tensor goes positionally: checkpoint infers from its positional arguments which
        # device's RNG state to keep for the recompute (a tensor passed by keyword is missed).
        out = checkpoint(run, *[flat[i] for i in tix], use_reentrant=False, preserve_rng_state=True)
        changed.extend(i for i in objs if _fingerprint(flat[i]) != before[i])
        return out

    return forward


def _replace(m: nn.Module, p: dict) -> dict:
    return {"": checkpointed(type(m).forward.__get__(m))}


def _match(path: str, m: nn.Module) -> dict | None:
    return {} if is_repeated_block(path, m) else None


def checkpoint_rule(paths: Iterable[str]) -> Rule:
    """The rule on the named module paths only (`model.layers.0`, ...), whatever their structure:
    `kprof.patch(model, rules=[checkpoint_rule(paths)])`."""
    want = frozenset(paths)
    if not want:
        raise KprofError("checkpoint_rule needs at least one module path, e.g. ['model.layers.0']")

    def match(path: str, m: nn.Module) -> dict | None:
        return {"paths": "named"} if path in want and any(True for _ in m.parameters()) else None

    return replace(RULE, match=match)


RULE = Rule(
    id=ID,
    title="activation checkpointing of the repeated blocks (memory for time)",
    kernels=(),
    match=_match,
    replace=_replace,
    # Never matched from the profile: the memory diagnosis of the same id plans it.
    profile=ProfilePattern(own_all=("<never>",)),
    change="torch.utils.checkpoint on each block (recomputed in the backward)",
    confidence="medium",
    wraps=True,
)
