"""What every rank runs for a command of its group (``_ranks``), rank 0 included.

``RankHost.run(header, tensors)`` does one command's work on this rank: ``setup`` builds the
``RankLearner`` from the run's settings (sent as plain data), ``step`` trains on the global
batch, ``step_rows`` on the rows this rank fetches of it (``_rank_fetch``), ``state`` gathers the full state dict, ``memory`` sums the bytes of the parameters and
the optimizer state over the ranks, ``gather`` all-gathers parameters one at a time
in the order of a weight sync, ``sync_send`` sends this rank's buckets of one (``_rank_send``), ``save``/``load``/``export`` are the distributed checkpoint.
A forward station's ranks (``_rank_forward``): ``forward_setup`` builds its shard of the
policy, ``forward`` computes a batch's log-probs (``forward_rows``: of the rows each rank
fetches, ``_forward_fetch``), ``forward_load`` loads full weights.
``serve`` is the loop of ranks > 0: receive a command, run it, until ``stop``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from ._compute import PaddedRows, pad_rows, setup_torch
from ._rank_forward import RankForward
from ._rank_learner import RankLearner, blocks, gather, gather_many
from ._rank_settings import LoraSettings, ParallelSettings
from ._ranks import receive_command
from ._settings import RunSpec
from ._threads import intra_op_threads

_ROWS = ("prompt_ids", "response_ids")


def spec_to_wire(spec: RunSpec) -> dict[str, Any]:
    """A ``RunSpec`` as plain data (msgpack-able)."""
    return attrs.asdict(spec, recurse=True)


def spec_from_wire(data: Mapping[str, Any]) -> RunSpec:
    """The ``RunSpec`` ``spec_to_wire`` made."""
    attrs.resolve_types(RunSpec)
    fields = {}
    for field in attrs.fields(RunSpec):
        value = data[field.name]
        if isinstance(field.type, type) and attrs.has(field.type):
            value = field.type(**value)
        fields[field.name] = value
    return RunSpec(**fields)


def encode_batch(data: Mapping[str, Any]) -> tuple[list[Any], list[Tensor]]:
    """A global batch (per-sample rows, ``PaddedRows`` or tensors) as a layout and tensors."""
    layout: list[Any] = []
    tensors: list[Tensor] = []
    for name, column in data.items():
        if isinstance(column, Tensor):
            layout.append([name, "tensor"])
            tensors.append(column)
            continue
        dtype = torch.long if name in _ROWS else torch.float32
        values, lengths = pad_rows(column, dtype, 0)
        layout.append([name, "rows"])
        tensors += [values, lengths]
    return layout, tensors


def decode_batch(layout: Sequence[Any], tensors: Sequence[Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    it = iter(tensors)
    for name, kind in layout:
        if kind == "tensor":
            out[name] = next(it)
            continue
        rows = PaddedRows(next(it), next(it))
        out[name] = rows.rows() if name in _ROWS else rows
    return out


class RankHost:
    """This rank's learner and the commands on it (module docstring)."""

    def __init__(self) -> None:
        self.learner: RankLearner | None = None
        self.forward: RankForward | None = None
        self.fetch: Any = None  # rank 0's way to its rows of a ``step_rows`` (None: the mesh)

    def run(self, header: Mapping[str, Any], tensors: Sequence[Tensor]) -> Any:
        op = header["op"]
        if op.startswith("forward"):
            return self._forward(op, header, tensors)
        if op == "setup":
            spec = spec_from_wire(header["spec"])
            setup_torch(intra_op_threads(spec))
            lora = header.get("lora")
            self.learner = RankLearner(
                spec,
                ParallelSettings(**header["parallel"]),
                None if lora is None else LoraSettings(**lora),
                path=header.get("path"),
            )
            return None
        learner = self.learner
        if learner is None:
            raise RuntimeError(f"command {op!r} before setup")
        if op == "step":
            return learner.step(decode_batch(header["layout"], tensors))
        if op == "step_rows":  # each rank fetches its rows from the TQ (``_rank_fetch``)
            from ._rank_fetch import step_rows

            return step_rows(learner, header, tensors, self.fetch)
        if op == "state":
            return learner.full_state_dict()
        if op == "grads":
            # the last update's gradients, whole, on rank 0 (tests compare them)
            out = {}
            for name, param in learner.policy.named_parameters():
                if param.grad is not None:
                    out[name] = gather(param.grad).detach().cpu()
            return out if torch.distributed.get_rank() == 0 else {}
        if op == "memory":
            return learner.memory()
        if op == "sync_send":
            from ._rank_send import serve_send

            return serve_send(learner, dict(header))
        if op == "gather":
            # the leader gathers the same tensors in the same order as it packs them
            params = dict(learner.named_parameters())
            for group in header["groups"]:
                gather_many([params[name] for name in group])
            return None
        if op in ("save", "load", "export"):
            from . import _rank_checkpoint as ckpt

            if op == "save":
                return ckpt.save(learner, header["directory"], header.get("meta", {}))
            if op == "load":
                return ckpt.load(learner, header["directory"])
            return ckpt.export(
                learner, header["directory"], merge=header.get("merge", True),
                name=header.get("name", "policy"),
            )  # fmt: skip
        raise RuntimeError(f"unknown rank command {op!r}")

    def _forward(self, op: str, header: Mapping[str, Any], tensors: Sequence[Tensor]) -> Any:
        """A forward station's commands (module docstring)."""
        if op == "forward_setup":
            spec = spec_from_wire(header["spec"])
            setup_torch(intra_op_threads(spec))
            parallel = ParallelSettings(**header["parallel"])
            self.forward = RankForward(spec, parallel, path=header.get("path"))
            return None
        forward = self.forward
        if forward is None:
            raise RuntimeError(f"command {op!r} before forward_setup")
        if op == "forward":
            rows = decode_batch(header["layout"], tensors)
            return forward.logprobs(
                rows["prompt_ids"], rows["response_ids"],
                pad_id=header["pad_id"], temperature=header["temperature"],
            )  # fmt: skip
        if op == "forward_rows":  # each rank fetches its rows from the TQ (``_forward_fetch``)
            from ._forward_fetch import forward_rows

            return forward_rows(forward, header, self.fetch)
        if op == "forward_load":
            return forward.load(dict(zip(header["names"], tensors, strict=True)))
        raise RuntimeError(f"unknown rank command {op!r}")


def serve() -> None:
    """Ranks > 0: run the leader's commands until it says stop (or the group breaks)."""
    from ._rank_mesh import close_rank_mesh

    host = RankHost()
    _fault_hook(host)
    try:
        while True:
            header, tensors = receive_command()
            if header["op"] == "stop":
                return
            host.run(header, tensors)
    finally:
        close_rank_mesh()  # the actor system a weight sync started here, if any


def _first(path: str) -> bool:  # pragma: no cover - a test hook
    """Whether this process created ``path`` (no other did before)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _fault_hook(host: RankHost) -> None:  # pragma: no cover - a test hook
    """``AFA_RANK_KILL_IN_BACKWARD``: this rank kills itself in its first backward;
    ``AFA_RANK_KILL_IN_FORWARD``: in its first forward command of a forward station (with
    ``AFA_RANK_KILL_ONCE=<file>``: only the first rank to get there, in the whole run) (tests)."""
    import signal

    me = str(torch.distributed.get_rank())
    if os.environ.get("AFA_RANK_KILL_IN_FORWARD") == me:
        original_run = host.run
        once = os.environ.get("AFA_RANK_KILL_ONCE")  # a file: only the rank that creates it dies

        def run_forward(header: Mapping[str, Any], tensors: Sequence[Tensor]) -> Any:
            if header["op"] in ("forward", "forward_rows") and (once is None or _first(once)):
                os.kill(os.getpid(), signal.SIGKILL)
            return original_run(header, tensors)

        host.run = run_forward  # type: ignore[method-assign]
    if os.environ.get("AFA_RANK_KILL_IN_BACKWARD") != me:
        return

    original = host.run

    def run(header: Mapping[str, Any], tensors: Sequence[Tensor]) -> Any:
        result = original(header, tensors)
        if header["op"] == "setup" and host.learner is not None:

            def arm(module: Any, args: Any, out: Any) -> None:
                out = out[0] if isinstance(out, tuple) else out
                if isinstance(out, Tensor) and out.requires_grad:
                    out.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))  # type: ignore[no-untyped-call]

            blocks(host.learner.policy)[-1].register_forward_hook(arm)
        return result

    host.run = run  # type: ignore[method-assign]
