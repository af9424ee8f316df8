"""kprof's pattern -> fix rules (shipped as `kprof.rules`).

`RULES` is the built-in list; its order is precedence (an object overridden by an earlier rule's
match is left alone by later ones). Norms come first (leaf modules), then the MLP patterns, then
inline patterns in a forward (torch.fx), attention, RoPE and the top-level loss. A user's rules (`--rules DIR`, see
examples/custom_rules/) go before the built-ins, so they win.
"""

from kprof.rules import (attention, checkpointing, cuda_graphs, fx_inline, gated_mlp, layer_norm, linear_cross_entropy,
                         linear_gelu, moe_fused, rms_norm, rope)
from kprof.rules.engine import Match, ProfilePattern, Rule, find_matches, load_rules, select

RULES: list[Rule] = [
    rms_norm.RULE,
    layer_norm.RULE,
    moe_fused.RULE,  # before gated_mlp: a patched MoE block no longer calls its experts' forwards
    gated_mlp.RULE,
    linear_gelu.RULE,
    fx_inline.RULE,  # after the module rules: only code no module swap reaches
    attention.RULE,
    rope.RULE,
    linear_cross_entropy.RULE,
]

# Rules that trade step time for memory (activation checkpointing): installed only when named by
# id, never by "all", since they make the step slower (`kprof apply --prefer memory` keeps them
# when they lower the peak). Last in precedence: a module another rule rewrites keeps that.
MEMORY_RULES: list[Rule] = [checkpointing.RULE]

# Rules that change how the whole step runs (CUDA graphs): installed only when named by id, as
# `kprof apply` does when the plan's cuda_graphs diagnosis holds, never by "all" (it compiles the
# whole model). Last in precedence: a root forward another rule rewrites (the fused linear +
# cross-entropy) keeps that.
STEP_RULES: list[Rule] = [cuda_graphs.RULE]


def all_rules(rules_dir=None) -> list[Rule]:
    """User rules from `rules_dir` (if any), then the built-ins."""
    return (load_rules(rules_dir) if rules_dir else []) + RULES


__all__ = ["MEMORY_RULES", "RULES", "STEP_RULES", "Match", "ProfilePattern", "Rule", "all_rules", "find_matches", "load_rules", "select"]
