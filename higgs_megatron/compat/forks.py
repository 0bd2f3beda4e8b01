"""The megatron-core methods we re-implement instead of calling, and the releases' bodies we read.

``HiggsBucketGroup`` replaces ``start_grad_sync`` (and ``finish_grad_sync`` with several
optimizer instances), and the checkpoint's owner-written optimizer state replaces
``sharded_param_state_fully_reshardable``: a change upstream makes to one of them is not
inherited. The symbol check sees a changed signature, not a changed body, and a supported series
("0.19") admits patch releases we have not read. So each such method's body is fingerprinted
(its syntax tree without docstring, comments or layout) and compared with the fingerprints of
the releases we compared ours with (``docs/megatron_compat.md`` says what each added): an
unread body is an untested release, refused unless ``--higgs-allow-untested-megatron``.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Fork:
    """``module:qualname`` of a method we re-implement; ``read``: the fingerprints of the
    releases' bodies ours follows, by release."""

    path: str
    read: dict[str, str]
    ours: str

    def installed(self):
        module_name, qualname = self.path.split(":")
        value = importlib.import_module(module_name)
        for part in qualname.split("."):
            value = getattr(value, part)
        return value

    def problem(self) -> str | None:
        """What differs in the installed release (None: a body we read)."""
        if fingerprint(self.installed()) in self.read.values():
            return None
        return (f"{self.path} is not the body of any release {self.ours} follows "
                f"({', '.join(self.read)}): upstream changed what we re-implement")


def fingerprint_node(node: ast.FunctionDef) -> str:
    """A function's syntax tree, docstring dropped: equal for bodies that differ only in
    comments, layout or documentation."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        node.body = body[1:]
    return hashlib.sha256(_dump(node).encode()).hexdigest()[:16]


def _dump(value) -> str:
    """``ast.dump`` without the fields a newer Python adds empty (3.12's ``type_params``): the
    same code reads the same under either supported Python."""
    if isinstance(value, ast.AST):
        fields = ((name, getattr(value, name, None)) for name in value._fields)
        return f"{type(value).__name__}({', '.join(f'{name}={_dump(field)}' for name, field in fields if field not in (None, []))})"
    if isinstance(value, list):
        return f"[{', '.join(_dump(item) for item in value)}]"
    return repr(value)


def fingerprint(function) -> str:
    """``fingerprint_node`` of a function's source."""
    node = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), function
    return fingerprint_node(node)


_BUCKETS = "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup"
FORKS = (
    Fork(f"{_BUCKETS}.start_grad_sync",
         {"0.16.1": "8672b6604d31da48", "0.19.0": "dc3541b7429f764c", "0.19.2": "dc3541b7429f764c"},
         "ddp.HiggsBucketGroup.start_grad_sync"),
    Fork(f"{_BUCKETS}.finish_grad_sync",
         {"0.16.1": "825955b39fbab889", "0.19.0": "e3d761d9e3f82afb", "0.19.2": "e3d761d9e3f82afb"},
         "ddp.HiggsBucketGroup.finish_grad_sync"),
    Fork("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_param_state_fully_reshardable",
         {"0.16.1": "1348eb8674566f6e", "0.19.0": "1348eb8674566f6e", "0.19.2": "1348eb8674566f6e"},
         "checkpoint.state.owner_param_state"),
)


def fork_problems() -> list[str]:
    """Every re-implemented method whose installed body we have not read."""
    return [problem for fork in FORKS if (problem := fork.problem()) is not None]
