"""`ckpt-planner show` on a hand-built profile whose numbers are worked out below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.cli import main
from solvers import Node, Profile, ProfileMeta

MIB = 2**20


def tiny_profile() -> Profile:
    # Storages: 0 = weight (1 MiB), 1 = input (0.5 MiB), 2 = mm out (3 MiB),
    # 3 = relu out (2.5 MiB), 4 = loss (4 B), 5 = grad of relu input (3 MiB).
    storage_bytes = (1 * MIB, MIB // 2, 3 * MIB, 5 * MIB // 2, 4, 3 * MIB)
    nodes = (
        Node(name="w", op="placeholder", phase="param", storage=0, new_storages=(0,)),
        Node(name="x", op="placeholder", phase="input", storage=1, new_storages=(1,)),
        # mm saves its inputs, which are fixed memory: they must not count as saved activations.
        Node(
            name="mm",
            op="aten.mm.default",
            phase="forward",
            inputs=("x", "w"),
            module="model.layers.0.fc",
            storage=2,
            new_storages=(2,),
            saves=(1, 0),
            flops=1000,
            bytes_moved=4000,
            time_ms=1.5,
        ),
        # relu saves its output: the one saved activation, 2.5 MiB, from module model.layers.0.act.
        Node(
            name="relu",
            op="aten.relu.default",
            phase="forward",
            inputs=("mm",),
            module="model.layers.0.act",
            storage=3,
            new_storages=(3,),
            saves=(3,),
            time_ms=0.25,
        ),
        Node(
            name="loss",
            op="aten.sum.default",
            phase="loss",
            inputs=("relu",),
            storage=4,
            new_storages=(4,),
            time_ms=0.125,
        ),
        Node(
            name="relu_bw",
            op="aten.threshold_backward.default",
            phase="backward",
            inputs=("relu",),
            grad_of="relu",
            storage=5,
            new_storages=(5,),
            time_ms=0.5,
        ),
    )
    meta = ProfileMeta(
        model_class="TinyMLP",
        device="cpu",
        device_name="Test CPU",
        mode="measure",
        dtype="float32",
        torch_version="2.13.0",
        input_shapes={"x": [4, 8]},
    )
    return Profile(
        nodes=nodes, storage_bytes=storage_bytes, model_outputs=("relu",), loss="loss", meta=meta
    )


def test_show_prints_counts_and_saved_bytes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tiny_profile().save(tmp_path / "tiny.json")
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "TinyMLP" in out
    assert "param 1, buffer 0, input 1, forward 2, loss 1, backward 1 (total 6)" in out
    # Fixed: 1 MiB weight + 0.5 MiB input.
    assert "fixed memory:   1.50 MiB" in out
    # Saved: only relu's 2.5 MiB output (mm's saved inputs are fixed memory).
    assert "saved activations: 2.50 MiB" in out
    # Step time: 1.5 + 0.25 + 0.125 + 0.5 ms.
    assert "2.375 ms" in out
    # Attributed to the allocating node's module, truncated to 3 components.
    top = out.split("modules by saved bytes:")[1]
    assert "model.layers.0" in top and "2.50 MiB" in top
    assert "model.layers.0.act" not in top
    assert "x=[4, 8]" in out


def test_show_gzip_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tiny_profile().save(tmp_path / "tiny.json.gz")
    assert main(["show", str(path), "--top", "1"]) == 0
    assert "saved activations: 2.50 MiB" in capsys.readouterr().out


def test_show_malformed_profile_names_field(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    d = tiny_profile().to_dict()
    del d["nodes"][2]["phase"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d), encoding="utf-8")
    assert main(["show", str(path)]) == 2
    err = capsys.readouterr().err
    assert "nodes[2]" in err and "'phase'" in err


def test_show_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["show", str(tmp_path / "nope.json")]) == 2
    assert "no such profile file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("no_colon_here", "module:function"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("json:no_such_function", "has no function 'no_such_function'"),
    ],
)
def test_profile_bad_spec(
    spec: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["profile", spec, "-o", str(tmp_path / "p.json")]) == 2
    assert expected in capsys.readouterr().err


def test_profile_for_fsdp_mixed_precision_then_plan_offline_per_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mp_spec.py").write_text(
        "from tests.models import hf_llama\n\n"
        "def tiny():\n"
        "    return hf_llama(batch=2, seq=16, layers=2, hidden=32, heads=2, kv_heads=1,\n"
        "                    intermediate=64, vocab=64)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "p.json.gz"
    assert main(["profile", "mp_spec:tiny", "-o", str(out), "--repeats", "1",
                 "--fsdp-param-dtype", "bfloat16", "--fsdp-reduce-dtype", "float32"]) == 0
    p = Profile.load(out)
    assert p.meta.fsdp_mixed_precision == {"param_dtype": "bfloat16", "orig_dtype": "float32",
                                           "reduce_dtype": "float32"}
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    assert "parameters cast from float32 to bfloat16" in capsys.readouterr().out
    # planned for one process it would be a bfloat16 step no one runs: refused, with the fix
    assert main(["plan", str(out), "--min"]) == 2
    assert "add --fsdp --world-size N" in capsys.readouterr().err
    assert main(["plan", str(out), "--min", "--fsdp", "--world-size", "2"]) == 0
    assert "computing in bfloat16, stored in float32, reduced in float32" in \
        capsys.readouterr().out
