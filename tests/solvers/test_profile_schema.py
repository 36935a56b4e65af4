"""The torch-free Profile schema: JSON round trips, validation errors, and importing without torch.

Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from solvers import Node, Profile, ProfileError, ProfileMeta

REPO = Path(__file__).resolve().parents[2]


def tiny_profile() -> Profile:
    """A hand-built valid profile of ``relu(x @ w).view(-1).mean()`` and its backward.

    Storages: 0 = w (param), 1 = x (input), 2 = mm, 3 = relu (viewed by `view`), 4 = the loss,
    5 = the seed gradient, 6 = grad of relu, 7 = grad of w.
    """
    nodes = (
        Node(name="w", op="placeholder", phase="param", storage=0, new_storages=(0,)),
        Node(name="x", op="placeholder", phase="input", storage=1, new_storages=(1,)),
        Node(
            name="mm",
            op="aten.mm.default",
            phase="forward",
            inputs=("x", "w"),
            module="lin",
            storage=2,
            new_storages=(2,),
            saves=(1, 0),
            flops=128,
            bytes_moved=112,
            time_ms=0.25,
        ),
        Node(
            name="relu",
            op="aten.relu.default",
            phase="forward",
            inputs=("mm",),
            module="act",
            storage=3,
            new_storages=(3,),
            saves=(3,),
            bytes_moved=32,
            time_ms=0.125,
        ),
        Node(name="view", op="aten.view.default", phase="forward", inputs=("relu",), storage=3),
        Node(
            name="mean",
            op="aten.mean.default",
            phase="loss",
            inputs=("view",),
            storage=4,
            new_storages=(4,),
            time_ms=0.5,
        ),
        Node(
            name="ones_like",
            op="aten.ones_like.default",
            phase="backward",
            inputs=("mean",),
            storage=5,
            new_storages=(5,),
        ),
        Node(
            name="threshold_backward",
            op="aten.threshold_backward.default",
            phase="backward",
            inputs=("ones_like", "relu"),
            grad_of="relu",
            storage=6,
            new_storages=(6,),
            time_ms=0.1,
        ),
        Node(
            name="mm_1",
            op="aten.mm.default",
            phase="backward",
            inputs=("x", "threshold_backward"),
            grad_of="mm",
            storage=7,
            new_storages=(7,),
            flops=128,
            time_ms=0.2,
        ),
    )
    return Profile(
        nodes=nodes,
        storage_bytes=(64, 32, 16, 16, 4, 16, 16, 64),
        model_outputs=("view",),
        loss="mean",
        grad_bytes=64,
        optimizer_state_bytes=128,
        optimizer_step_bytes=64,
        meta=ProfileMeta(
            model_class="Tiny",
            device_name="test CPU",
            torch_version="2.13.0",
            input_shapes={"x": [2, 8]},
            created="2025-01-01T00:00:00",
            step_ms_measured=1.5,
        ),
    )


def _node(d: dict, name: str) -> dict:
    return next(n for n in d["nodes"] if n["name"] == name)


def _write(path: Path, d: dict) -> Path:
    path.write_text(json.dumps(d), encoding="utf-8")
    return path


# -- valid profiles ------------------------------------------------------------------------------


def test_tiny_profile_is_valid_and_derived_quantities():
    p = tiny_profile()
    assert p.param_bytes == 64
    assert p.input_bytes == 32
    assert p.buffer_bytes == 0
    assert p.fixed_bytes == 64 + 32 + 128
    assert p.saved_storages == {3}  # x and w are fixed memory
    assert p.saved_bytes == 16
    assert p.forward_indices == [2, 3, 4]
    assert p.index("relu") == 3
    assert p.step_ms == pytest.approx(0.25 + 0.125 + 0.5 + 0.1 + 0.2)
    assert p.forward_ms == pytest.approx(0.375)
    with pytest.raises(KeyError, match="no node named 'nope'"):
        p.index("nope")


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_save_load_round_trip(tmp_path, suffix):
    p = tiny_profile()
    path = p.save(tmp_path / "sub" / f"tiny{suffix}")
    assert path.exists()
    raw = path.read_bytes()
    if suffix.endswith(".gz"):
        assert raw[:2] == b"\x1f\x8b"  # really gzip
        json.loads(gzip.decompress(raw))
    else:
        json.loads(raw)
    q = Profile.load(path)
    assert q.to_dict() == p.to_dict()
    assert q == p
    assert q.meta == p.meta
    assert q.nodes == p.nodes
    # and a second round trip is stable too
    r = Profile.load(q.save(tmp_path / f"again{suffix}"))
    assert r == p


def test_from_dict_round_trip_and_defaults_omitted():
    p = tiny_profile()
    d = p.to_dict()
    assert d["schema"] == "ckpt-planner/profile"
    assert d["schema_version"] == 2
    view = _node(d, "view")
    assert set(view) == {"name", "op", "phase", "inputs", "storage"}
    assert Profile.from_dict(json.loads(json.dumps(d))) == p


def test_load_ignores_unknown_meta_fields(tmp_path):
    d = tiny_profile().to_dict()
    d["meta"]["recorded_by"] = "someone newer"
    assert Profile.load(_write(tmp_path / "p.json", d)) == tiny_profile()


# -- malformed profiles ----------------------------------------------------------------------------


def _set(key, value):
    def edit(d):
        d[key] = value

    return edit


def _del_nodes(d):
    del d["nodes"]


def _del_name(d):
    del d["nodes"][3]["name"]


def _unknown_field(d):
    _node(d, "relu")["colour"] = "red"


def _cycle(d):
    # mm reads relu, and relu reads mm
    _node(d, "mm")["inputs"] = ["x", "w", "relu"]


def _dangling(d):
    _node(d, "relu")["inputs"] = ["ghost"]


def _negative_bytes(d):
    d["storage_bytes"][2] = -1


def _storage_out_of_range(d):
    _node(d, "relu")["storage"] = 99


def _new_storage_out_of_range(d):
    _node(d, "relu")["new_storages"] = [3, 8]


def _allocated_twice(d):
    _node(d, "relu")["new_storages"] = [3, 2]


def _no_grad_not_allocated(d):
    _node(d, "relu")["no_grad_storages"] = [2]


def _storage_part_out_of_range(d):
    _node(d, "relu")["storage_parts"] = [77]


def _storage_parts_without_storage(d):
    _node(d, "relu")["storage"] = None
    _node(d, "relu")["storage_parts"] = [2]


def _saves_on_backward(d):
    _node(d, "threshold_backward")["saves"] = [3]


def _before_unpack_on_forward(d):
    _node(d, "relu")["before_unpack"] = True


MALFORMED = {
    "unknown schema_version": (
        _set("schema_version", 99),
        r"schema_version 99 is not supported",
    ),
    "wrong schema name": (_set("schema", "someone-else/graph"), r"field 'schema' is"),
    "missing field nodes": (_del_nodes, r"missing field 'nodes'"),
    "node missing name": (_del_name, r"nodes\[3\] is missing field 'name'"),
    "unknown node field": (
        _unknown_field,
        r"nodes\[3\] \('relu'\) has unknown fields \['colour'\]",
    ),
    "cycle": (_cycle, r"nodes\[2\] \('mm'\): input 'relu' comes later in the graph"),
    "dangling input": (_dangling, r"input 'ghost' is not a node of this profile"),
    "negative storage bytes": (_negative_bytes, r"storage_bytes\[2\] is -1"),
    "storage id out of range": (_storage_out_of_range, r"storage id 99 is out of range"),
    "new storage id out of range": (_new_storage_out_of_range, r"storage id 8 is out of range"),
    "storage allocated twice": (
        _allocated_twice,
        r"nodes\[3\] \('relu'\): allocates storage 2, already allocated by 'mm'",
    ),
    "no_grad storage it does not allocate": (
        _no_grad_not_allocated,
        r"'relu'\): no_grad_storages \[2\] are not among the storages it allocates",
    ),
    "sparse index storage out of range": (_storage_part_out_of_range,
                                          r"storage id 77 is out of range"),
    "sparse index storages without a storage": (
        _storage_parts_without_storage,
        r"'relu'\): storage_parts without a storage",
    ),
    "saves on a backward node": (
        _saves_on_backward,
        r"'threshold_backward'.*only forward and loss nodes save tensors",
    ),
    "before_unpack on a forward node": (
        _before_unpack_on_forward,
        r"'relu'\): before_unpack is set on a node that is not one of an autograd node's",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_profile_raises_profile_error(tmp_path, case):
    edit, match = MALFORMED[case]
    d = tiny_profile().to_dict()
    edit(d)
    path = _write(tmp_path / "bad.json", d)
    with pytest.raises(ProfileError, match=match) as info:
        Profile.load(path)
    assert str(path) in str(info.value)  # the message says which file
    with pytest.raises(ProfileError, match=match):
        Profile.from_dict(d)


def test_profile_error_is_a_value_error():
    d = tiny_profile().to_dict()
    d["schema_version"] = 3
    with pytest.raises(ValueError):
        Profile.from_dict(d)


def test_direct_construction_validates():
    p = tiny_profile()
    nodes = list(p.nodes)
    nodes[3] = dataclasses.replace(nodes[3], inputs=("ghost",))
    with pytest.raises(ProfileError, match="'ghost' is not a node"):
        dataclasses.replace(p, nodes=tuple(nodes))
    with pytest.raises(ProfileError, match=r"duplicate node name"):
        dataclasses.replace(p, nodes=(*p.nodes, p.nodes[-1]))
    with pytest.raises(ProfileError, match=r"phase 'forward' comes after a 'backward' node"):
        dataclasses.replace(p, nodes=(*p.nodes, Node(name="late", op="x", phase="forward")))
    with pytest.raises(ProfileError, match=r"phase 'sideways' is not one of"):
        dataclasses.replace(p, nodes=(Node(name="odd", op="x", phase="sideways"), *p.nodes))
    with pytest.raises(ProfileError, match=r"grad_of is set on a 'forward' node"):
        nodes = list(p.nodes)
        nodes[3] = dataclasses.replace(nodes[3], grad_of="mm")
        dataclasses.replace(p, nodes=tuple(nodes))
    with pytest.raises(ProfileError, match=r"python_backward is set on a 'forward' node"):
        nodes = list(p.nodes)
        nodes[3] = dataclasses.replace(nodes[3], python_backward=True)
        dataclasses.replace(p, nodes=tuple(nodes))
    with pytest.raises(ProfileError, match=r"loss names 'nope'"):
        dataclasses.replace(p, loss="nope")
    with pytest.raises(ProfileError, match=r"model_outputs names 'nope'"):
        dataclasses.replace(p, model_outputs=("nope",))
    with pytest.raises(ProfileError, match=r"grad_bytes is -1"):
        dataclasses.replace(p, grad_bytes=-1)


# Values of the wrong JSON type must raise ProfileError, never a TypeError or AttributeError.
WRONG_TYPES = {
    "time_ms is NaN": lambda d: _node(d, "relu").__setitem__("time_ms", float("nan")),
    "python_backward is a string":
        lambda d: _node(d, "relu").__setitem__("python_backward", "yes"),
    "before_unpack is a number":
        lambda d: _node(d, "threshold_backward").__setitem__("before_unpack", 1),
    "time_ms is inf": lambda d: _node(d, "relu").__setitem__("time_ms", float("inf")),
    "meta is not an object": lambda d: d.__setitem__("meta", None),
    "nodes is not a list": lambda d: d.__setitem__("nodes", 5),
    "storage_bytes is not a list": lambda d: d.__setitem__("storage_bytes", 5),
    "inputs holds a list": lambda d: _node(d, "relu").__setitem__("inputs", [["mm"]]),
    "new_storages is an int": lambda d: _node(d, "relu").__setitem__("new_storages", 3),
    "grad_bytes is a bool": lambda d: d.__setitem__("grad_bytes", True),
}


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_wrong_types_raise_profile_error(case):
    d = tiny_profile().to_dict()
    WRONG_TYPES[case](d)
    with pytest.raises(ProfileError):
        Profile.from_dict(d)


def test_not_json_file(tmp_path):
    path = tmp_path / "garbage.json"
    path.write_text("this is { not json", encoding="utf-8")
    with pytest.raises(ProfileError, match=r"garbage\.json: not valid JSON"):
        Profile.load(path)


def test_not_gzip_file(tmp_path):
    path = tmp_path / "plain.json.gz"
    path.write_text(json.dumps(tiny_profile().to_dict()), encoding="utf-8")
    with pytest.raises(ProfileError, match=r"plain\.json\.gz: not valid JSON"):
        Profile.load(path)


def test_json_that_is_not_an_object(tmp_path):
    path = _write(tmp_path / "list.json", [1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ProfileError, match=r"expected a JSON object, found list"):
        Profile.load(path)


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match=r"no such profile file"):
        Profile.load(tmp_path / "nowhere.json")
    with pytest.raises(ProfileError, match=r"no such profile file"):
        Profile.load(tmp_path / "nowhere.json.gz")


# -- importing without torch -----------------------------------------------------------------------


def _run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_solvers_without_torch(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(REPO)
    check = ("import sys, solvers, solvers.baselines, solvers.dp, solvers.ilp; "
             "assert 'torch' not in sys.modules, 'solvers imported torch'")
    r = _run_python(check, env)
    assert r.returncode == 0, r.stderr

    # Now make torch unimportable: a shadowing package first on the path that refuses to import,
    # next to empty sitecustomize/usercustomize modules so no site hook can pull torch in first.
    blocker = tmp_path / "blocker"
    (blocker / "torch").mkdir(parents=True)
    (blocker / "torch" / "__init__.py").write_text('raise ImportError("torch blocked")\n')
    (blocker / "sitecustomize.py").write_text("")
    (blocker / "usercustomize.py").write_text("")
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), str(REPO)])

    r = _run_python("import torch", env)
    assert r.returncode != 0 and "torch blocked" in r.stderr, "the torch blocker does not work"

    r = _run_python(check + "; from solvers import Profile, ProfileError; print('ok')", env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
