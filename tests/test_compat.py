"""Private torch / Lightning APIs go through ``lightning_parallel.compat`` (and ``compat_lightning``) only.

Why: a torch or Lightning upgrade that moves a private name should break one module, at import,
with the name of what moved. The scan below fails when any other module of the package imports a
private name from torch or Lightning, reaches one through an attribute chain, or touches one of
the private attributes the compat modules wrap; the resolution tests fail when the installed
torch or Lightning no longer has an entry. No process group, no Trainer: fast.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path

import pytest
import torch

import lightning_parallel
from lightning_parallel import compat, compat_lightning

PACKAGE = Path(lightning_parallel.__file__).parent
COMPAT_FILES = {PACKAGE / "compat.py", PACKAGE / "compat_lightning.py"}
ROOTS = {"torch", "lightning", "lightning_fabric", "pytorch_lightning"}
PRIVATE_ATTRIBUTES = compat.PRIVATE_ATTRIBUTES | compat_lightning.PRIVATE_ATTRIBUTES


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _receiver_is_own(node: ast.expr) -> bool:
    """``self.x`` / ``cls.x`` / ``super().x``: a class's own (or inherited) attribute, not a reach-in."""
    if isinstance(node, ast.Name):
        return node.id in {"self", "cls"}
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every private torch/Lightning name ``source`` uses outside the compat modules."""
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    bound: set[str] = set()  # local names bound to torch/Lightning modules or objects
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in ROOTS:
                    bound.add(alias.asname or parts[0])
                    if any(_private(p) for p in parts):
                        found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] in ROOTS:
                for alias in node.names:
                    bound.add(alias.asname or alias.name)
                    if any(_private(p) for p in parts) or _private(alias.name):
                        found.append((node.lineno, f"from {node.module} import {alias.name}"))
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # report a chain once
    chained: set[int] = set()  # lines already reported for a torch/Lightning attribute chain
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound and any(_private(p) for p in chain):
                found.append((node.lineno, f"{base.id}.{'.'.join(reversed(chain))}"))
                chained.add(node.lineno)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES and node.lineno not in chained
                and not _receiver_is_own(node.value)):
            found.append((node.lineno, f"<object>.{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in {"getattr", "hasattr", "setattr", "delattr"} and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in PRIVATE_ATTRIBUTES):
            found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    return sorted(set(found))


def test_scanner_flags_every_kind_of_private_use() -> None:
    """The scan itself can fail: each forbidden pattern is reported, the allowed ones are not."""
    bad = "\n".join([
        "import torch.distributed._functional_collectives as funcol",
        "from torch.utils._pytree import tree_map",
        "from torch.distributed.tensor.placement_types import _StridedShard",
        "from lightning.fabric.utilities.distributed import _init_dist_connection",
        "import torch",
        "import torch.distributed as dist",
        "from torch.nn.parallel import DistributedDataParallel",
        "torch._foreach_norm([])",
        "dist.distributed_c10d._resolve_process_group('g')",
        "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(m, [])",
        "mesh._flatten('dp')",
        "getattr(t, '_local_tensor', None)",
        "module._trainer",
    ])
    assert len(private_uses(bad)) == 10, private_uses(bad)
    good = "\n".join([
        "import torch",
        "from torch.distributed.tensor import DTensor, Shard",
        "from lightning_parallel.compat import tree_map, StridedShard as _StridedShard",
        "x = torch.nn.Linear(2, 2)",
        "self._stages = []",
        "super()._create_act_send_info()",
        "module._parameters['w'] = None",  # nn.Module's contract, by judgement (see compat)
    ])
    assert private_uses(good) == []


def test_no_module_uses_private_torch_or_lightning_names_directly() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in COMPAT_FILES:
            continue
        for line, what in private_uses(path.read_text()):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {what}")
    assert not offenders, (
        "private torch/Lightning names used outside lightning_parallel/compat*.py; add a named wrapper there "
        "(what it is, why, since which release, the public API to move to) and import it:\n" + "\n".join(offenders)
    )


# Private attributes read on objects of other libraries that are NOT routed through compat, by
# judgement (see the compat module's docstring). Anything else private read on a foreign object
# must be defined by the package itself or be wrapped in compat.
NN_MODULE_CONTRACT = {"_parameters", "_buffers", "_modules", "_apply"}
OTHER_LIBRARIES = {
    "_gradient_checkpointing_func", "_is_hf_initialized", "_initialize_weights", "_pp_plan", "_tp_plan",  # transformers
    "_attn_implementation",  # transformers: the config field set_attn_implementation writes (checked after it)
    "_defaults", "_forward_cache", "_update_count", "_computed",  # torchmetrics.Metric
    "_exit", "_getframe",  # os, sys
}


def _own_private_names(tree: ast.AST) -> set[str]:
    """Private names the package defines itself: defs, classes, assignments, setattr/dict keys."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Call) and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name in {"setattr", "__setattr__"}:
                own.add(str(node.args[1].value))
        elif isinstance(node, ast.Dict):
            own.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return own


def _foreign_private_reads(tree: ast.AST) -> dict[str, int]:
    """Private attribute name -> a line, for ``x._name`` / ``getattr(x, "_name")`` on objects not ``self``."""
    reads: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _receiver_is_own(node.value):
            reads.setdefault(node.attr, node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"getattr", "hasattr"}
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            reads.setdefault(node.args[1].value, node.lineno)
    return reads


def test_no_module_reads_an_unlisted_private_attribute_of_another_library() -> None:
    """A private attribute of a torch/Lightning object read anywhere but compat (``mesh._foo``,
    ``getattr(stage, "_bar")``) fails here unless the package defines that name itself."""
    trees = {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py")) if path not in COMPAT_FILES}
    own = set().union(*(_own_private_names(tree) for tree in trees.values()))
    allowed = own | NN_MODULE_CONTRACT | OTHER_LIBRARIES
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}: .{name}"
                 for path, tree in trees.items() for name, line in _foreign_private_reads(tree).items()
                 if name not in allowed or name in PRIVATE_ATTRIBUTES]
    assert not offenders, "private attributes of other libraries read outside compat (wrap them there):\n" + "\n".join(offenders)


def test_foreign_private_read_detection_can_fail() -> None:
    tree = ast.parse("mesh._get_root_mesh()\ngetattr(stage, '_stage_meta')\nself._mine = 1\nx._mine\nsuper()._hook()")
    assert set(_foreign_private_reads(tree)) - _own_private_names(tree) == {"_get_root_mesh", "_stage_meta"}


def _resolve(target: str) -> object:
    module_name, _, attrs = target.partition(":")
    obj: object = importlib.import_module(module_name)
    for attr in attrs.split("."):
        obj = getattr(obj, attr)
    return obj


@pytest.mark.parametrize("entry", compat.PRIVATE_APIS + compat_lightning.PRIVATE_APIS, ids=lambda e: e.name)
def test_every_compat_entry_resolves_and_is_exported(entry: compat.PrivateApi) -> None:
    """Fails on the first torch/Lightning release that moves or drops one of the private names."""
    assert _resolve(entry.target) is not None
    module = compat if entry in compat.PRIVATE_APIS else compat_lightning
    assert hasattr(module, entry.name.split(".")[0]), f"{module.__name__} does not export {entry.name}"
    assert entry.since and entry.public


@pytest.mark.parametrize("owner, attribute", [
    # instance attributes, set in __init__: read from the source, since no class attribute exists
    ("torch.distributed.pipelining.schedules:PipelineScheduleSingle", "self._stage ="),
    ("torch.distributed.pipelining.schedules:PipelineScheduleMulti", "self._stages ="),
    ("torch.export.unflatten:InterpreterModule", "self._run_with_interpreter ="),
    ("torch.nn.modules.module:Module", '"_forward_pre_hooks"'),  # module_has_hooks reads the four hook dicts
    ("torch.nn.modules.module:Module", '"_backward_pre_hooks"'),
    ("torch.distributed.pipelining.stage:_PipelineStageBase", "self._stage_meta"),  # TracedStage rewrites it
])
def test_instance_attributes_the_wrappers_rely_on_still_exist(owner: str, attribute: str) -> None:
    assert attribute in inspect.getsource(_resolve(owner)), f"{owner} no longer sets {attribute}"


def _bounds(requirement: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from packaging.requirements import Requirement

    spec = Requirement(requirement).specifier
    lower = next(s.version for s in spec if s.operator == ">=")
    upper = next(s.version for s in spec if s.operator == "<")
    return tuple(int(x) for x in lower.split(".")), tuple(int(x) for x in upper.split("."))


def test_pyproject_pins_match_the_compat_bounds_and_the_installed_versions() -> None:
    """pyproject's lower bounds are the compat modules' (one source of truth), and what is
    installed (the tested versions) lies inside the pinned ranges."""
    import tomllib

    import lightning

    pyproject = PACKAGE.parent / "pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    deps = {d.split(">")[0].split("<")[0].strip(): d for d in dependencies}
    for name, module, lower_bound in (("torch", torch, compat.TORCH_LOWER_BOUND),
                                      ("lightning", lightning, compat_lightning.LIGHTNING_LOWER_BOUND)):
        lower, upper = _bounds(deps[name])
        assert lower[:2] == lower_bound, f"pyproject {deps[name]!r} vs compat lower bound {lower_bound}"
        installed = tuple(int(x) for x in module.__version__.split("+")[0].split(".")[:2])
        assert lower[:2] <= installed < upper[:2], f"installed {name} {module.__version__} outside {deps[name]!r}"


if __name__ == "__main__":  # a quick listing for a torch upgrade: python tests/test_compat.py
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, what in ([] if path in COMPAT_FILES else private_uses(path.read_text())):
            print(f"{path}:{line}: {what}", file=sys.stderr)
