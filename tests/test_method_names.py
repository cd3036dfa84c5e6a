"""A method owns its behaviour: its name is spelled out (as a string) in its own module, the registry, the rule
table and docs/tests, and elsewhere only where a file still branches on it. Each file's count may only go down."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from atorch.opt_lib.registry import METHOD_MODULES, method_names

PACKAGE = Path(__file__).resolve().parent.parent / "atorch"
ALLOWED = {"opt_lib/registry.py", "opt_lib/compatibility.py"}  # the registry and the rules table name every method
# String constants equal to a method's name, per file (outside the method's own module). Lower a figure when a file
# stops naming a method; a file not listed may name none. Elsewhere a method's behaviour is asked of the method (its
# hooks: apply, cost_facts, compute_dtype, trace_problem, casts, optimizer_need, ...) and a name read off its class
# (TensorParallel.name), so a renamed or changed method cannot leave a stale copy behind. What is left below is not
# a method's behaviour decided outside it.
MOST: dict[str, int] = {
    "booster/mixed_precision.py": 1,  # "fp8": Colossal-AI's precision flag, spelled like the method
    "booster/plugin/torch_ddp.py": 1,  # the precision flags it accepts
    "lightning/state.py": 1,  # "checkpoint": where a value is written, not the method
    # the sharding methods' shared code, below their classes (importing them would make an import circle)
    "opt_lib/deepspeed_zero.py": 2,  # runs_on_fsdp2: zero1 next to a tensor dimension
    "opt_lib/fsdp_keys.py": 3,  # zero2's and fsdp's FSDP2 keywords
    "opt_lib/zero1.py": 1,  # runs_as="zero2" next to a tensor dimension
    "strategy_search/cluster/cluster_plan.py": 6,  # the --layout field fp8= (the CLI's vocabulary)
}


def method_name_literals() -> Counter[str]:
    names = set(method_names())
    found: Counter[str] = Counter()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ALLOWED:
            continue
        own = {name for name, module in METHOD_MODULES.items() if rel == f"opt_lib/{module}.py"}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names - own:
                found[rel] += 1
    return found


def test_method_names_are_spelled_out_no_more_often_than_before() -> None:
    found = method_name_literals()
    print(f"method-name string literals outside their methods' modules: {sum(found.values())}")
    grown = {rel: (count, MOST.get(rel, 0)) for rel, count in found.items() if count > MOST.get(rel, 0)}
    assert not grown, f"files naming methods more often than allowed (found, allowed): {grown}; let the method say it"
