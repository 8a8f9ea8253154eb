"""Expert parallel (parallel.ep) on the manifest side, no ranks: the layout's ep coordinates, the rules that
name the field and the fix, `mantra validate` refusing ep for a model without experts, and the dry-run's ep
columns. Training with ep on real ranks is tests/test_expert_parallel_training.py.
"""

from __future__ import annotations


def test_layout_carves_ep_from_dp_times_cp():
    """Layout.expert_coords numbers ranks as the mesh does (dp x cp flattened replicate-major, cp innermost;
    ep the innermost ep of those); the world size and the other coordinates do not change with ep."""
    from trainer.manifest.layout import Layout

    plain, layout = Layout(dp_replicate=2, dp_shard=2, cp=2, tp=2), Layout(dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4)
    assert layout.world_size == plain.world_size == 16 and layout.sizes == plain.sizes
    groups: dict[tuple, list[int]] = {}
    for rank in range(16):
        c, e = layout.coords(rank), layout.expert_coords(rank)
        assert c == plain.coords(rank)
        flat = (c["dp_replicate"] * 2 + c["dp_shard"]) * 2 + c["cp"]
        assert e == {"ep": flat % 4, "edp": flat // 4}
        groups.setdefault((c["tp"], e["edp"]), []).append(e["ep"])  # an ep group: same tp, same edp
    assert all(sorted(members) == [0, 1, 2, 3] for members in groups.values()) and len(groups) == 4
    assert Layout(dp_shard=4, ep=2).expert_coords(3) == {"ep": 1, "edp": 1}
    assert layout.label(5) == "DP4-CP2-TP2-EP4-rank5"


def _manifest(tmp_path, parallel: str, nproc: int = 4):
    path = tmp_path / "m.yaml"
    path.write_text(f"""\
name: t
model: {{dim: 32, layers: 2, heads: 4, kv_heads: 2, ffn_dim: 64, vocab: 256, seq_len: 32}}
train: {{global_batch: 8, micro_batch: 2, steps: 5}}
data: {{source: synthetic}}
launcher: {{nproc: {nproc}}}
parallel: {parallel}
""")
    return path


def test_ep_rules_name_the_field_and_the_fix(tmp_path):
    """ep must divide dp_replicate·dp_shard·cp (the MoE kind checks experts % ep), and a kind without experts
    refuses any ep > 1."""
    import types

    from trainer.manifest.rules import expert_parallel_degree
    from trainer.manifest.schema import Manifest

    import yaml

    def findings(parallel: dict, nproc: int = 4, experts: int | None = 8):
        data = yaml.safe_load(_manifest(tmp_path, "{}", nproc).read_text())
        m = Manifest.model_validate(data | {"parallel": parallel})
        if experts is not None:  # an MoE kind's section (this test does not wait for the moe kind)
            m = m.model_copy(update={"model": types.SimpleNamespace(kind="moe", experts=experts)})
        return [(f.field, f.message) for f in expert_parallel_degree(m)]

    assert findings({"ep": 2}) == [] and findings({"ep": 4, "dp_replicate": 4}) == []
    assert findings({"ep": 2, "dp_shard": 2, "cp": 2, "optimizer_sharding": "zero1"}) == []  # carved from dp x cp
    assert findings({"ep": 4, "dp_shard": 2, "cp": 2, "optimizer_sharding": "zero1"}) == []
    (field, message), = findings({"ep": 3})
    assert field == "parallel.ep" and "does not divide" in message and "4·1·1 = 4" in message and "1, 2 or 4" in message
    (field, message), = findings({"ep": 4, "tp": 2})  # tp ranks are not data parallel: dp is 2
    assert field == "parallel.ep" and "= 2" in message
    (field, message), = findings({"ep": 2}, experts=None)  # the llama section: no experts
    assert field == "parallel.ep" and "has none" in message and "ep: 1" in message


def test_validate_refuses_ep_for_a_model_without_experts(tmp_path, capsys):
    from launchers.cli import main

    path = _manifest(tmp_path, "{ep: 2}")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:6:" in err and "error: parallel.ep: 2 shards experts" in err and "Traceback" not in err


def test_dry_run_shows_each_ranks_ep_coordinates(tmp_path):
    """The dry-run table gains ep and edp columns (the world stays dp_replicate·dp_shard·cp·tp·pp). Resolved
    directly: the rules refuse ep on this file's llama, and the table does not depend on the kind."""
    import yaml
    from rich.console import Console

    from launchers.dry_run import print_dry_run
    from trainer.manifest.resolve import resolve
    from trainer.manifest.schema import Manifest

    data = yaml.safe_load(_manifest(tmp_path, "{dp_replicate: 2, dp_shard: 2, ep: 2, optimizer_sharding: zero1}").read_text())
    run = resolve(Manifest.model_validate(data), "m.yaml")
    assert run.world_size == 4 and run.layout.ep == 2
    console = Console(record=True, width=200)
    print_dry_run(run, console)
    text = console.export_text()
    assert "ep 2 carved from dp·cp 4 (expert-dp 2)" in text
    header = next(line for line in text.splitlines() if "dp_replicate" in line and "edp" in line)
    rows = [line.split("│")[1:-1] for line in text.splitlines() if "-rank" in line]
    columns = [c.strip() for c in header.split("┃")[1:-1]]
    got = [{k: v.strip() for k, v in zip(columns, row)} for row in rows]
    assert [(r["ep"], r["edp"]) for r in got] == [("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")], text
    assert got[3]["label"] == "DP4-EP2-rank3"
