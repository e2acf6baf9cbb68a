"""A storage unit on its own: blocks, zero-copy fetches, rewrites, deletes, inventory."""

from __future__ import annotations

import pytest
import torch

import asyncflow_actors as afa
from asyncflow_actors.actors.remote._wire import RawTensor
from asyncflow_actors.transfer_queue import _storage as S


def raw(t: torch.Tensor) -> RawTensor:
    return RawTensor(
        str(t.dtype).removeprefix("torch."), tuple(t.shape), memoryview(t.numpy()).cast("B")
    )


@pytest.mark.parametrize("as_raw", [False, True])
async def test_store_fetch_rewrite_delete(as_raw: bool) -> None:
    wrap = raw if as_raw else (lambda t: t)
    tokens = torch.arange(24).reshape(6, 4)
    async with afa.open_actor_system() as system:
        unit = await system.spawn(lambda: S.StorageUnit("u"), name="u")
        sizes = await unit.ask(
            S.Store("t", [10, 11, 12, 13, 14, 15], [0] * 6, list(range(6)), [1] * 6,
                    {"tokens": wrap(tokens), "text": ["a", "bb", "c", "d", "e", "f"]})
        )  # fmt: skip
        assert sizes == [32 + 1, 32 + 2, 33, 33, 33, 33]
        got = await unit.ask(S.Fetch("t", [11, 12, 13], ["tokens", "text"], [], []))
        value = got.columns["tokens"]
        assert torch.equal(value.to_torch() if as_raw else value, tokens[1:4])
        assert got.columns["text"] == ["bb", "c", "d"]
        out_of_order = await unit.ask(S.Fetch("t", [15, 10], ["tokens"], [], []))
        v = out_of_order.columns["tokens"]
        assert torch.equal(v.to_torch() if as_raw else v, tokens[[5, 0]])
        stats = await unit.ask(S.GetStorageStatistics())
        assert (stats.samples, stats.zero_copy_fetches, stats.nbytes) == (6, 1, 32 * 6 + 7)
        # a computed column arrives later for some samples; a rewrite replaces bytes, not adds
        await unit.ask(
            S.Store("t", [11, 12], [0, 0], [1, 2], [1, 1], {"lp": wrap(torch.ones(2, 4))})
        )
        await unit.ask(S.Store("t", [11], [0], [1], [1], {"lp": wrap(torch.zeros(1, 4))}))
        got = await unit.ask(S.Fetch("t", [11, 12], ["lp", "tokens"], [], []))
        lp = got.columns["lp"]
        assert torch.equal(lp.to_torch() if as_raw else lp, torch.tensor([[0.0] * 4, [1.0] * 4]))
        assert (await unit.ask(S.GetStorageStatistics())).nbytes == 32 * 6 + 7 + 16 * 2
        inv = await unit.ask(S.GetInventory())
        by_index = {s.index: s for s in inv.samples["t"]}
        assert by_index[11].columns == {"tokens": 32, "text": 2, "lp": 16}
        unit.send_nowait(S.UnitBatch([S.Delete("t", [10, 11, 12, 13, 14, 15], [])]))
        stats = await unit.ask(S.GetStorageStatistics())
        assert (stats.samples, stats.nbytes) == (0, 0)
        with pytest.raises(Exception, match="holds no samples"):
            await unit.ask(S.Fetch("t", [10], ["tokens"], [], []))
        assert (await unit.ask(S.GetStorageStatistics())).samples == 0  # bad input: no crash
