from __future__ import annotations

import pytest

from asyncflow_actors.transfer_queue import (
    ColumnSpec,
    SchemaError,
    TopicSpec,
    UnknownColumn,
    topic_specs_from_dict,
)


def spec(**kw: object) -> TopicSpec:
    base: dict[str, object] = {
        "name": "rollout",
        "columns": {"prompt_ids": ColumnSpec(shared=True), "response_ids": ColumnSpec()},
        "consumers": ("trainer",),
    }
    base.update(kw)
    return TopicSpec(**base)  # type: ignore[arg-type]


def test_column_spec_normalises_and_checks() -> None:
    col = ColumnSpec(dtype="torch.int64", shape=[None, 4096])
    assert col.dtype == "int64" and col.shape == (None, 4096) and not col.shared
    col.check("torch.int64", (17, 4096))
    with pytest.raises(SchemaError, match="expected dtype int64, got float32"):
        col.check("float32", (17, 4096))
    with pytest.raises(SchemaError, match=r"expected shape \(\*, 4096\), got \(17, 4095\)"):
        col.check("int64", (17, 4095))
    with pytest.raises(SchemaError, match="expected shape"):
        col.check("int64", (4096,))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "int46"}, "dtype 'int46' is not one of"),
        ({"dtype": 3}, "dtype must be a string"),
        ({"shape": (2, -1)}, "int >= 0 or None"),
        ({"shape": "2"}, "sequence of dimensions"),
        ({"shared": 1}, "'shared' must be a bool"),
    ],
)
def test_column_spec_rejects(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        ColumnSpec(**kwargs)  # type: ignore[arg-type]


def test_topic_spec_defaults_and_views() -> None:
    s = spec()
    assert s.staleness == 0 and s.capacity is None and s.lease_ttl == 60.0
    assert s.shared_columns == {"prompt_ids"} and s.sample_columns == {"response_ids"}
    assert s.column("prompt_ids").shared
    with pytest.raises(UnknownColumn, match="no column 'nope'"):
        s.check_column("nope", "int64", ())
    assert hash(s) == hash(spec())  # columns are excluded from the hash, not from equality
    assert s != spec(columns={"x": ColumnSpec()})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": ""}, "topic name must be a non-empty string"),
        ({"consumers": ()}, "at least one consumer"),
        ({"consumers": ("a", "a")}, "consumers must be unique"),
        ({"consumers": "trainer"}, "sequence of names"),
        ({"columns": {}}, "at least one column"),
        ({"columns": {"x": 1}}, "must be a ColumnSpec"),
        ({"staleness": -1}, "staleness must be an int >= 0, got -1"),
        ({"staleness": True}, "staleness must be an int >= 0, got True"),
        ({"capacity": 0}, "capacity must be an int >= 1, got 0"),
        ({"lease_ttl": 0}, "lease_ttl must be a finite number of seconds > 0"),
        ({"lease_ttl": float("inf")}, "lease_ttl"),
    ],
)
def test_topic_spec_rejects(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        spec(**kwargs)


def test_staleness_zero_is_a_valid_window() -> None:
    assert spec(staleness=0).staleness == 0


TOML_TABLE = {
    "rollout": {
        "consumers": ["actor_fwd", "ref_fwd", "advantage", "trainer"],
        "staleness": 1,
        "capacity": 4096,
        "lease_ttl": 30,
        "columns": {
            "prompt_ids": {"dtype": "int64", "shape": [-1], "shared": True},
            "response_ids": {"dtype": "int64", "shape": [-1]},
            "rewards": {"dtype": "float32", "shape": []},
        },
    }
}


def test_from_dict_loads_a_toml_table() -> None:
    (s,) = topic_specs_from_dict(TOML_TABLE)
    assert s.name == "rollout"
    assert s.consumers == ("actor_fwd", "ref_fwd", "advantage", "trainer")
    assert s.staleness == 1 and s.capacity == 4096 and s.lease_ttl == 30
    assert s.columns["prompt_ids"] == ColumnSpec(dtype="int64", shape=(None,), shared=True)
    assert s.columns["rewards"].shape == ()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: t.update(stalenes=1), r"topic 'rollout': unknown keys \['stalenes'\]"),
        (lambda t: t.pop("consumers"), "topic 'rollout': missing 'consumers'"),
        (lambda t: t.update(staleness=-2), "topic 'rollout': .*staleness must be an int >= 0"),
        (
            lambda t: t["columns"]["rewards"].update(dtype="f32"),
            "topic 'rollout'.columns.rewards: column dtype 'f32'",
        ),
        (
            lambda t: t["columns"]["rewards"].update(size=3),
            r"columns.rewards: unknown keys \['size'\]",
        ),
        (lambda t: t.update(name="other"), "'name' is 'other' but the table is 'rollout'"),
        (lambda t: t.update(columns=[1]), "columns: expected a table of columns"),
    ],
)
def test_from_dict_errors_name_the_key(mutate: object, message: str) -> None:
    import copy

    table = copy.deepcopy(TOML_TABLE)
    mutate(table["rollout"])  # type: ignore[operator]
    with pytest.raises(SchemaError, match=message):
        topic_specs_from_dict(table)


def test_from_dict_without_name() -> None:
    with pytest.raises(SchemaError, match="missing 'name'"):
        TopicSpec.from_dict({"consumers": ["a"], "columns": {"x": {}}})
    s = TopicSpec.from_dict({"name": "t", "consumers": ["a"], "columns": {"x": {}}})
    assert s.columns["x"] == ColumnSpec()
