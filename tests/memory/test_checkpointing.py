"""Activation checkpointing as a patch (issue 28 item 3): installed on the repeated blocks,
verified forward + backward against the original (weight gradients and dropout included),
switched on and off by the ablation, and its groups kept apart from the patches inside it."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kprof
from kprof.errors import KprofError
from kprof.patching import ablation as ab
from kprof.rules.checkpointing import ID, checkpoint_rule, is_repeated_block


class Block(nn.Module):
    def __init__(self, d=16, p=0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v
        x = x + self.drop(self.proj(a))
        return x + self.drop(self.down(torch.relu(self.up(self.ln2(x)))))


class Net(nn.Module):
    def __init__(self, n=3, p=0.0):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(Block(p=p) for _ in range(n))
        self.head = nn.Linear(16, 32)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def _grads(model, ids, seed=0):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = model(ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_repeated_blocks_are_the_outermost_indexed_items():
    net = Net()
    found = [p for p, m in net.named_modules() if is_repeated_block(p, m)]
    assert found == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["fp32", "dropout"])
def test_installs_on_the_blocks_and_matches_the_original(p):
    torch.manual_seed(0)
    net = Net(p=p).train()
    ids = torch.randint(0, 32, (2, 8))
    ref_loss, ref = _grads(net, ids)
    rep = kprof.patch(net, rules=[ID])
    assert [r.path for r in rep.records] == ["blocks.0", "blocks.1", "blocks.2"]
    loss, _ = _grads(net, ids)  # first calls: each block verifies fwd + bwd, then runs patched
    assert [r.status for r in rep.records] == ["verified"] * 3, str(rep)
    checked = {c.what for c in rep.records[0].verification.checks}
    # the block's output, its input's gradient and every weight's gradient were compared
    assert {"output 0", "grad input 0", "grad qkv.weight", "grad up.weight", "grad ln1.weight"} <= checked
    loss2, got2 = _grads(net, ids)  # the installed patch alone, same seed: same dropout masks
    for a, b in ((loss, ref_loss), (loss2, ref_loss)):
        torch.testing.assert_close(a, b)
    for n in ref:
        torch.testing.assert_close(got2[n], ref[n], msg=n)
    assert "forward" in net.blocks[0].__dict__  # an instance-level forward, removed by unpatch
    rep.unpatch()
    assert "forward" not in net.blocks[0].__dict__


def test_toggles_off_and_on():
    torch.manual_seed(0)
    net = Net()
    ids = torch.randint(0, 32, (2, 8))
    rep = kprof.patch(net, rules=[ID])
    _grads(net, ids)
    assert rep.toggle_sets() == [(ID,)] * 3
    rep.enable_only([])
    assert "forward" not in net.blocks[1].__dict__
    off = _saved_bytes(net, ids)
    rep.enable_only([ID])
    assert "forward" in net.blocks[1].__dict__
    on = _saved_bytes(net, ids)
    assert on < off / 2, (on, off)  # the blocks keep their inputs only, not their activations


def _saved_bytes(model, ids):
    """Bytes the autograd graph of one forward keeps for the backward (outside checkpoints)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids)
    return sum(seen.values())


def test_not_installed_by_all_and_named_paths():
    net = Net()
    rep = kprof.patch(net, rules="all", verify=False)
    assert ID not in {r.rule for r in rep.records}
    rep.unpatch()
    rep = kprof.patch(net, rules=[checkpoint_rule(["blocks.1"])])
    assert [r.path for r in rep.records] == ["blocks.1"]
    with pytest.raises(KprofError, match="at least one module path"):
        checkpoint_rule([])


def test_ablation_keeps_inner_patches_apart():
    recs = [(ID, "model.layers.0", True), ("rms_norm", "model.layers.0.input_layernorm", True)]
    assert ab.groups_of(recs, wrapping=[ID]) == [(ID,), ("rms_norm",)]
    assert ab.groups_of(recs) == [(ID, "rms_norm")]


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "kv-cache"])
def test_hf_llama_decoder_layers(use_cache):
    """The decoder layers are the blocks; with the model's default KV cache (filled in training)
    the recompute gets no cache, and the result still equals the original."""
    m = _tiny_llama()
    ids = torch.randint(0, 64, (2, 8))

    def step():
        m.zero_grad(set_to_none=True)
        out = m(ids, labels=ids, use_cache=use_cache)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    ref_loss, ref = step()
    rep = kprof.patch(m, rules=[ID])
    assert [r.path for r in rep.records] == ["model.layers.0", "model.layers.1"]
    step()
    assert [r.status for r in rep.records] == ["verified"] * 2, str(rep)
    loss, got = step()
    torch.testing.assert_close(loss, ref_loss)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)
    rep.unpatch()


def test_largest_batch_search_doubles_then_bisects():
    from kprof.patching.batch import search

    tried = []

    def fits(b):
        tried.append(b)
        return b <= 37

    assert search(fits, 4, 256) == 37
    assert tried[:5] == [4, 8, 16, 32, 64]  # doubling to the first failure, then bisection
    assert search(lambda b: True, 4, 100) == 100  # capped at the limit
    assert search(lambda b: False, 4, 100) is None  # the script's own batch does not fit


def test_largest_batch_wiring_in_the_ablation(monkeypatch):
    """The search at the ablation's end: the root's last input, every patch off then on, the
    gradients put back, the input hook removed (the trials run on CUDA; here a fake limit)."""
    from kprof.patching import apply as ap
    from kprof.patching import batch

    torch.manual_seed(0)
    net = Net()
    abl = ap._Ablation([ID], strict=False, rules_dir=None, budget=None, seed=0, find_batch=True)
    abl.on_root(net)
    ids = torch.randint(0, 32, (2, 8))
    net(ids).backward()
    grads = [p.grad.clone() for p in net.parameters()]
    seen = []
    real = batch.trial(net, (ids,), {})  # runs on a CPU too, just never out of memory

    def fake_trial(mod, args, kwargs):
        def fits(b):
            seen.append(("on" if "forward" in net.blocks[0].__dict__ else "off", b))
            assert real(b)  # a real forward + backward at batch b
            return b <= (6 if seen[-1][0] == "off" else 11)
        return fits

    monkeypatch.setattr(batch, "trial", fake_trial)
    abl.cuda = True
    out = abl._largest_batch()
    assert out == {"script_batch": 2, "limit": 2 * batch.MAX_FACTOR, "before": 6, "after": 11}
    assert {s for s, _ in seen} == {"off", "on"}
    assert abl.hooks == [] and abl.last_call is None
    for p, g in zip(net.parameters(), grads):
        torch.testing.assert_close(p.grad, g)
    for rep in abl.reports:
        rep.unpatch()


@pytest.mark.gpu
def test_largest_batch_trial_on_cuda():
    from kprof.patching.batch import search, trial

    net = Net().cuda()
    ids = torch.randint(0, 32, (2, 8), device="cuda")
    grads = [p.grad for p in net.parameters()]
    got = search(trial(net, (ids,), {}), 2, 64)
    assert got == 64  # a tiny model fits the cap
    assert [p.grad for p in net.parameters()] == grads  # the trials left the gradients alone


def test_plan_ids_and_the_kept_line():
    from kprof.patching.apply import live_rules, write_lines
    from kprof.plan.suggest import parse_ids

    plan = {"run": "r", "suggestions": [{"id": "layer_norm", "applyable": True}],
            "diagnoses": [{"id": ID, "applyable": True, "paths": ["blocks.1", "blocks.0"]}]}
    assert parse_ids("all", plan) == ["layer_norm"]  # costs time: only under --prefer memory
    assert parse_ids("all", plan, memory=True) == ["layer_norm", ID]
    assert parse_ids(ID, plan) == [ID]
    plan["diagnoses"][0]["applyable"] = False  # a plan saved before the rule shipped
    assert parse_ids(ID, plan) == [ID]
    rules = live_rules(["layer_norm", ID], plan)
    assert rules[0] == "layer_norm" and rules[1].id == ID
    net = Net()
    rep = kprof.patch(net, rules=[rules[1]], verify=False)
    assert sorted(r.path for r in rep.records) == ["blocks.0", "blocks.1"]
    text = write_lines([ID], False, ["blocks.1"])
    assert "checkpoint_rule(['blocks.1'])" in text
    model = Net()
    ns = {"model": model}
    exec(text, ns)  # the written lines run and install on the named block only
    assert [r.path for r in ns["kprof_report"].records] == ["blocks.1"]


SCRIPT = '''
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.ln, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)
    def forward(self, x):
        h = self.ln(x)
        a = torch.softmax(h @ h.transpose(-1, -2) / 4.0, dim=-1) @ h
        return x + self.drop(self.down(torch.relu(self.up(a))))
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(40):
    ids = torch.randint(0, 64, (8, 128))
    model(ids).backward()
    opt.step()
    opt.zero_grad()
'''


@pytest.mark.slow
def test_apply_checkpointing_prefer_memory_json_on_cpu(tmp_path):
    """`kprof apply --patch activation_checkpointing --prefer memory --json` end to end on a CPU:
    the diagnosis plans it, both blocks verify, the ablation times it, peak memory is reported
    before and after as the process RSS it is, and the batch search says it is skipped."""
    import json

    import typer
    from typer.testing import CliRunner

    from kprof.analyze.profile import profile_script
    from kprof.cli import patch_cmds

    script, root = tmp_path / "train.py", tmp_path / "runs"
    script.write_text(SCRIPT)
    profile_script(str(script), [], warmup=1, steps=2, out_root=root)
    app = typer.Typer()
    patch_cmds.register(app)
    res = CliRunner().invoke(app, ["apply", str(script), "--patch", ID, "--prefer", "memory", "--steps", "14",
                                   "--out", str(root), "--json"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    recs = doc["records"]["ablation"]
    assert [(r["rule"], r["path"], r["status"]) for r in recs] == [(ID, "blocks.0", "verified"),
                                                                     (ID, "blocks.1", "verified")]
    assert doc["ablation"]["groups"] == [[ID]]
    (p,) = doc["patches"]
    assert p["id"] == ID and p["n"] == 6 and p["verdict"] in ("kept", "dropped", "undecided")
    pm = doc["peak_memory"]
    assert pm["before"] > 0 and pm["after"] > 0 and "RSS" in pm["kind"]
    assert any("peak RSS on this CPU" in n for n in doc["notes"])
    assert "not measured on a CPU" in doc["largest_batch"]["skipped"]


def test_inner_patches_verify_inside_a_checkpointed_block():
    """A kernel patch inside a checkpointed block verifies at its first call and again at a new
    shape, from inside the checkpoint's forward: its own graph must not be captured by the
    checkpoint's saved-tensor hooks. Results equal the unpatched model's."""
    torch.manual_seed(0)
    net = Net(n=2)
    ref_net = Net(n=2)
    ref_net.load_state_dict(net.state_dict())
    outer = kprof.patch(net, rules=[ID])
    _grads(net, torch.randint(0, 32, (2, 8)))  # the blocks verified: checkpointed from now on
    inner = kprof.patch(net, rules=["layer_norm"])  # first called inside the checkpoint
    assert len(inner.records) == 4  # two LayerNorms a block
    for shape in ((2, 8), (2, 8), (3, 8)):
        ids = torch.randint(0, 32, shape)
        loss, got = _grads(net, ids)
        ref_loss, ref = _grads(ref_net, ids)
        torch.testing.assert_close(loss, ref_loss)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], msg=n)
    assert all(r.status == "verified" for r in outer.records + inner.records), str(inner)
    inner.unpatch()
    outer.unpatch()
