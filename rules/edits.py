"""Exact source changes for the fixes `kprof apply` cannot install: a unified diff against the
user's file, built from its real lines (ast positions, then difflib), or the reason none can be
derived safely. Nothing is imported or run; every builder returns a `diff` record:

    {"file": "train.py", "line": 21, "unified_diff": "--- train.py\\n+++ train.py\\n@@ ...",
     "reason": None}
    {"file": None, "line": None, "unified_diff": None, "reason": "why there is no exact change"}

The headers name the file as the profile recorded it, relative to the working directory when it
lies under it, so `patch -p0 < diffs/<id>.patch` applies from there (`patch` alone, in the file's
folder, uses the base name).

Builders only edit what they can prove from the code itself: keyword arguments of one call
(`fused=True`, `num_workers=2`, `non_blocking=True`), one integer literal where a size is defined
(a vocab padded to a multiple of 64), one flag assignment (TF32), and the hand-written attention
chain `S = q @ kᵀ * c; S = S.masked_fill(causal, -inf); S = softmax(S); [dropout]; y = S @ v` ->
`y = F.scaled_dot_product_attention(q, k, v, ...)`. Anything else gets a reason.
"""

from __future__ import annotations

import ast
import difflib
import os
from pathlib import Path


def no_diff(reason: str) -> dict:
    return {"file": None, "line": None, "unified_diff": None, "reason": reason}


class _NoEdit(Exception):
    """Raised by a builder: the message is the reason no exact change is derived."""


def _read(path: str | None) -> tuple[str, ast.Module]:
    if not path or not Path(path).is_file():
        raise _NoEdit(f"the source file {path or '(unknown)'} is not readable here, so no exact change is derived")
    try:
        text = Path(path).read_text()
        return text, ast.parse(text, filename=path)
    except (SyntaxError, OSError, UnicodeDecodeError, ValueError) as e:
        raise _NoEdit(f"{path} could not be parsed ({type(e).__name__}), so no exact change is derived") from None


def label(path: str) -> str:
    """The file name in the diff's headers: relative to the working directory when under it."""
    p = os.path.abspath(path)
    rel = os.path.relpath(p)
    return p if rel.startswith("..") else rel


def _offset(lines: list[str], lineno: int, col: int) -> int:
    """Character offset in the whole text of an ast position (col_offset counts UTF-8 bytes)."""
    before = sum(len(x) for x in lines[: lineno - 1])
    return before + len(lines[lineno - 1].encode()[:col].decode(errors="ignore"))


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    for start, end, new in sorted(edits, key=lambda e: e[0], reverse=True):
        text = text[:start] + new + text[end:]
    return text


def make_diff(path: str, old: str, new: str) -> dict:
    """The diff record of `old` -> `new` (the whole file's text)."""
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    name = label(path)
    out = []
    for ln in difflib.unified_diff(a, b, fromfile=name, tofile=name, n=3):
        out.append(ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n")
    if not out:
        return no_diff("the change is already in the source")
    first = next(i for i, (x, y) in enumerate(zip(a + [None], b + [None])) if x != y) + 1
    return {"file": name, "line": first, "unified_diff": "".join(out), "reason": None}


def _guard(build):
    """Run a builder; its _NoEdit becomes the no-diff record with the reason."""
    def run(*args, **kwargs) -> dict:
        try:
            return build(*args, **kwargs)
        except _NoEdit as e:
            return no_diff(str(e))

    run.__doc__, run.__name__ = build.__doc__, build.__name__
    return run


def _callee(call: ast.Call) -> str | None:
    return getattr(call.func, "attr", getattr(call.func, "id", None))


def _pos(lines, node, end=False) -> int:
    return _offset(lines, node.end_lineno, node.end_col_offset) if end else _offset(lines, node.lineno, node.col_offset)


def _kwarg_edits(text: str, call: ast.Call, set_kw: dict[str, str], drop: tuple[str, ...] = ()) -> list:
    """Edits that give `call` the keywords `set_kw` (replacing a value already there) and remove
    the keywords in `drop`."""
    lines = text.splitlines(keepends=True)
    if any(k.arg is None for k in call.keywords):
        raise _NoEdit(f"the {_callee(call)}(...) call passes **kwargs, which may already hold the keyword: "
                      "no safe textual change")
    edits, args = [], [*call.args, *call.keywords]
    for i, kw in enumerate(call.keywords):
        if kw.arg in drop:
            j = args.index(kw)
            if j == 0:
                raise _NoEdit(f"{kw.arg}= is the first argument of {_callee(call)}(...): no safe textual change")
            edits.append((_pos(lines, args[j - 1], end=True), _pos(lines, kw.value, end=True), ""))
        elif kw.arg in set_kw:
            edits.append((_pos(lines, kw.value), _pos(lines, kw.value, end=True), set_kw[kw.arg]))
    have = {k.arg for k in call.keywords}
    add = ", ".join(f"{k}={v}" for k, v in set_kw.items() if k not in have)
    if add:
        kept = [a for a in args if not (isinstance(a, ast.keyword) and a.arg in drop)]
        if kept:
            at = _pos(lines, kept[-1].value if isinstance(kept[-1], ast.keyword) else kept[-1], end=True)
            edits.append((at, at, ", " + add))
        else:  # f(): right after the "(" that follows the callee
            at = text.index("(", _pos(lines, call.func, end=True)) + 1
            edits.append((at, at, add))
    return edits


def _call_at(tree: ast.Module, line: int, names: tuple[str, ...]) -> ast.Call:
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and _callee(c) in names
             and c.lineno <= line <= c.end_lineno]
    if not calls:
        raise _NoEdit(f"no {'/'.join(names)}(...) call found at line {line}")
    return min(calls, key=lambda c: (c.end_lineno - c.lineno, c.col_offset))


@_guard
def call_keywords(path: str, line: int, names: tuple[str, ...], set_kw: dict[str, str],
                  drop: tuple[str, ...] = ()) -> dict:
    """Set keyword arguments of the `names(...)` call at `line` (e.g. fused=True on an AdamW)."""
    text, tree = _read(path)
    return make_diff(path, text, _apply(text, _kwarg_edits(text, _call_at(tree, line, names), set_kw, drop)))


@_guard
def many_calls(path: str, changes: list[tuple[int, tuple[str, ...], dict[str, str]]]) -> dict:
    """Several calls' keywords in one diff: [(line, callee names, {keyword: value})]."""
    text, tree = _read(path)
    edits = []
    for line, names, kw in changes:
        edits += _kwarg_edits(text, _call_at(tree, line, names), kw)
    return make_diff(path, text, _apply(text, edits))


@_guard
def literal(path: str, line: int, old: int, new: int) -> dict:
    """Replace the integer literal `old` on `line` by `new`, where it defines a size: the value of
    an assignment or of a keyword argument (`vocab_size = 50257`, `default=50257`)."""
    text, tree = _read(path)
    lines = text.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        values = []
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            values = [node.value]
        elif isinstance(node, ast.keyword):
            values = [node.value]
        for v in values:
            if isinstance(v, ast.Constant) and type(v.value) is int and v.value == old and v.lineno == line:
                found.append(v)
    if len(found) != 1:
        raise _NoEdit(f"{old} on line {line} is not the one value of an assignment or keyword argument, so "
                      "which use sets the matmul's size is not certain: no exact change")
    v = found[0]
    return make_diff(path, text, _apply(text, [(_pos(lines, v), _pos(lines, v, end=True), str(new))]))


def _torch_alias(tree: ast.Module) -> tuple[str, ast.stmt] | None:
    for st in tree.body:
        if isinstance(st, ast.Import):
            for a in st.names:
                if a.name == "torch":
                    return a.asname or "torch", st
    return None


@_guard
def tf32(path: str) -> dict:
    """TF32 for fp32 matmuls: the script's own `...matmul.allow_tf32 = X` set to True, else the line
    after its top-level `import torch`."""
    text, tree = _read(path)
    lines = text.splitlines(keepends=True)
    sets = [n for n in ast.walk(tree) if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Attribute) and t.attr == "allow_tf32" and isinstance(t.value, ast.Attribute)
        and t.value.attr == "matmul" for t in n.targets)]
    if sets:
        edits = [(_pos(lines, s.value), _pos(lines, s.value, end=True), "True") for s in sets]
        return make_diff(path, text, _apply(text, edits))
    imp = _torch_alias(tree)
    if imp is None:
        raise _NoEdit("the script has no top-level `import torch` to put the TF32 switch after")
    alias, st = imp
    at = _offset(lines, st.end_lineno + 1, 0) if st.end_lineno < len(lines) else len(text)
    nl = "" if text.endswith("\n") or not text else "\n"
    return make_diff(path, text, _apply(text, [(at, at, f"{nl}{alias}.backends.cuda.matmul.allow_tf32 = True  "
                                                        "# TF32 tensor cores for fp32 matmuls\n")]))


# ---------------------------------------------------------------------------------------------
# Hand-written attention -> F.scaled_dot_product_attention

_SOFTMAX = ("softmax",)


def _seg(text: str, node: ast.AST) -> str:
    return ast.get_source_segment(text, node)


def _assign_to(st: ast.stmt) -> str | None:
    if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
        return st.targets[0].id
    return None


def _is_name(n: ast.AST, name: str) -> bool:
    return isinstance(n, ast.Name) and n.id == name


def _is_matmul(n: ast.AST) -> tuple[ast.AST, ast.AST] | None:
    if isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult):
        return n.left, n.right
    if isinstance(n, ast.Call) and _callee(n) == "matmul" and len(n.args) == 2 and not n.keywords:
        return n.args[0], n.args[1]
    return None


def _untransposed(text: str, kt: ast.AST) -> str | None:
    """`k.transpose(-2, -1)` / `k.transpose(-1, -2)` / `k.mT` -> "k"."""
    if isinstance(kt, ast.Attribute) and kt.attr == "mT":
        return _seg(text, kt.value)
    if (isinstance(kt, ast.Call) and isinstance(kt.func, ast.Attribute) and kt.func.attr == "transpose"
            and len(kt.args) == 2 and not kt.keywords):
        dims = {ast.literal_eval(a) if isinstance(a, (ast.Constant, ast.UnaryOp)) else None for a in kt.args}
        if dims == {-2, -1}:
            return _seg(text, kt.func.value)
    return None


def _tril_names(tree: ast.Module) -> set[str]:
    """Names and buffer names bound to an expression built with tril (a causal keep-mask), also
    through names bound to one (`mask = torch.tril(...)`; `register_buffer("causal", mask.view(...))`)."""
    out: set[str] = set()

    def causal(n: ast.AST) -> bool:
        return any((isinstance(c, ast.Call) and _callee(c) == "tril")
                   or (isinstance(c, ast.Name) and c.id in out) for c in ast.walk(n))

    for _ in range(3):  # a mask passes through at most a couple of names
        for n in ast.walk(tree):
            if isinstance(n, ast.Assign) and causal(n.value):
                for t in n.targets:
                    out |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
                    out |= {x.attr for x in ast.walk(t) if isinstance(x, ast.Attribute)}
            elif isinstance(n, ast.Call) and _callee(n) == "register_buffer" and len(n.args) >= 2 \
                    and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str) and causal(n.args[1]):
                out.add(n.args[0].value)
    return out


def _functional(tree: ast.Module) -> str | None:
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name == "torch.nn.functional" and a.asname:
                    return a.asname
        if isinstance(n, ast.ImportFrom) and n.module == "torch.nn":
            for a in n.names:
                if a.name == "functional":
                    return a.asname or "functional"
    imp = _torch_alias(tree)
    return f"{imp[0]}.nn.functional" if imp else None


def _body_of(tree: ast.Module, line: int) -> tuple[list[ast.stmt], int]:
    """The statement list holding the statement at `line`, and its index there."""
    for n in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(n, field, None)
            if isinstance(body, list):
                for i, st in enumerate(body):
                    if isinstance(st, ast.stmt) and st.lineno <= line <= st.end_lineno \
                            and not any(isinstance(c, ast.stmt) for c in ast.iter_child_nodes(st)):
                        return body, i
    raise _NoEdit(f"no simple statement at line {line}")


@_guard
def sdpa(path: str, softmax_line: int, causal: bool | None = None) -> dict:
    """Replace the chain around the softmax at `softmax_line` by one SDPA call (see the module
    docstring). `causal`: what the profile found (None: not known), checked against the code's
    mask, which must be built with tril/triu for is_causal=True."""
    text, tree = _read(path)
    lines = text.splitlines(keepends=True)
    body, i = _body_of(tree, softmax_line)
    sm = body[i]
    a = _assign_to(sm)
    call = sm.value if a else None
    if not (isinstance(call, ast.Call) and _callee(call) in _SOFTMAX):
        raise _NoEdit(f"line {softmax_line} is not `scores = softmax(scores, dim=-1)`: no exact SDPA change")
    src = call.args[0] if call.args else (call.func.value if isinstance(call.func, ast.Attribute) else None)
    dim = [k.value for k in call.keywords if k.arg == "dim"] + list(call.args[1:2])
    if not (src is not None and _is_name(src, a)) or len(dim) != 1 or _seg(text, dim[0]).replace(" ", "") != "-1":
        raise _NoEdit("the softmax is not over the last dim of the scores variable itself (a cast or another "
                      "dim): no exact SDPA change")
    if any(k.arg not in ("dim",) for k in call.keywords):
        raise _NoEdit("the softmax takes a dtype or other keyword: SDPA's precision differs, no exact change")
    # Backwards: scale and mask statements on the same variable, down to the scores matmul.
    scale, mask, start = None, None, None
    for j in range(i - 1, -1, -1):
        st = body[j]
        if _assign_to(st) != a:
            raise _NoEdit(f"line {st.lineno} sits inside the attention chain and is not part of it: no exact "
                          "SDPA change")
        v = st.value
        if isinstance(v, ast.BinOp) and isinstance(v.op, (ast.Mult, ast.Div)):
            left, right = v.left, v.right
            mm = _is_matmul(left)
            if mm is None and isinstance(v.op, ast.Mult):
                mm, (left, right) = _is_matmul(right), (right, left)
            factor = right
            if scale is not None:
                raise _NoEdit("the scores are scaled twice: no exact SDPA change")
            scale = f"1.0 / ({_seg(text, factor)})" if isinstance(v.op, ast.Div) else f"({_seg(text, factor)})"
            if mm is not None:
                q, kt = mm
                start = j
                break
            if not _is_name(left, a):
                raise _NoEdit(f"line {st.lineno} scales something else than the scores: no exact SDPA change")
            continue
        mm = _is_matmul(v)
        if mm is not None:
            q, kt = mm
            start = j
            break
        if (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "masked_fill"
                and _is_name(v.func.value, a) and len(v.args) == 2 and mask is None):
            fill = _seg(text, v.args[1]).replace(" ", "")
            if fill not in ('float("-inf")', "float('-inf')", "-float('inf')", '-float("inf")', "-math.inf",
                            "-torch.inf", "float('-inf')"):
                raise _NoEdit(f"the mask fills {fill}, not -inf: no exact SDPA change")
            mask = v.args[0]
            continue
        raise _NoEdit(f"line {st.lineno} changes the scores in a way SDPA does not take: no exact change")
    if start is None:
        raise _NoEdit("the scores matmul (q @ k.transpose(-2, -1)) was not found before the softmax")
    k = _untransposed(text, kt)
    if k is None:
        raise _NoEdit("the scores are not q @ k.transpose(-2, -1): no exact SDPA change")
    # Forwards: optional dropout, then y = scores @ v, and no later use of the scores.
    dropout = None
    j = i + 1
    if j < len(body) and _assign_to(body[j]) == a and isinstance(body[j].value, ast.Call):
        d = body[j].value
        if (isinstance(d.func, ast.Attribute) and "drop" in d.func.attr.lower() and d.func.attr != "dropout"
                and len(d.args) == 1 and _is_name(d.args[0], a) and not d.keywords):
            mod = _seg(text, d.func)  # self.attn_dropout(att)
            dropout = f"{mod}.p if self.training else 0.0"
        elif _callee(d) == "dropout" and d.args and _is_name(d.args[0], a):
            p = next((x for x in d.args[1:2]), None) or next((k_.value for k_ in d.keywords if k_.arg == "p"), None)
            tr = next((x for x in d.args[2:3]), None) or next((k_.value for k_ in d.keywords if k_.arg == "training"),
                                                             None)
            if p is None or tr is None:
                raise _NoEdit("the dropout's p or training flag is implicit: no exact SDPA change")
            dropout = f"{_seg(text, p)} if {_seg(text, tr)} else 0.0"
        else:
            raise _NoEdit(f"line {body[j].lineno} changes the attention weights: no exact SDPA change")
        j += 1
    if j >= len(body):
        raise _NoEdit("no `y = scores @ v` after the softmax")
    pv = body[j]
    y = _assign_to(pv)
    mm = _is_matmul(pv.value) if y else None
    if not (mm and _is_name(mm[0], a)):
        raise _NoEdit(f"line {pv.lineno} is not `y = scores @ v`: no exact SDPA change")
    later = [n for st in body[j + 1:] for n in ast.walk(st) if _is_name(n, a)]
    if later and y != a:
        raise _NoEdit(f"the attention weights are used again at line {later[0].lineno} (SDPA does not return "
                      "them): no exact change")
    if mask is not None:
        names = {x.id for x in ast.walk(mask) if isinstance(x, ast.Name)} | \
                {x.attr for x in ast.walk(mask) if isinstance(x, ast.Attribute)}
        # masked_fill fills where the mask is True: a tril keep-mask must be negated to mask the future.
        negated = (isinstance(mask, ast.UnaryOp) and isinstance(mask.op, ast.Invert)) or (
            isinstance(mask, ast.Compare) and len(mask.ops) == 1 and isinstance(mask.ops[0], ast.Eq)
            and isinstance(mask.comparators[0], ast.Constant) and mask.comparators[0].value == 0)
        if not names & _tril_names(tree) or not negated or causal is False:
            raise _NoEdit("the mask is not the negation of a causal tril mask the code builds itself (a padding, "
                          "argument or triu mask): pass it to SDPA as attn_mask by hand")
    fn = _functional(tree)
    if fn is None:
        raise _NoEdit("the file imports neither torch nor torch.nn.functional")
    args = [_seg(text, q), k, _seg(text, mm[1])]
    if dropout:
        args.append(f"dropout_p={dropout}")
    if mask is not None:
        args.append("is_causal=True")
    args.append(f"scale={scale or '1.0'}")
    first, last = body[start], pv
    indent = lines[first.lineno - 1][: len(lines[first.lineno - 1]) - len(lines[first.lineno - 1].lstrip())]
    if lines[first.lineno - 1].strip()[: 1] != text[_pos(lines, first)] or \
            text[_pos(lines, last, end=True):].split("\n", 1)[0].strip()[:1] not in ("", "#"):
        raise _NoEdit("the chain shares a line with other statements: no exact SDPA change")
    new = f"{indent}{y} = {fn}.scaled_dot_product_attention({', '.join(args)})\n"
    begin = _offset(lines, first.lineno, 0)
    end = _offset(lines, last.end_lineno, 0) + len(lines[last.end_lineno - 1])
    return make_diff(path, text, _apply(text, [(begin, end, new)]))
