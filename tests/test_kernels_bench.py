"""The kernel benchmark runs end to end on CPU with a tiny shape and writes its JSON."""

from __future__ import annotations

import json

from specextend.bench import kernels


def test_kernel_benchmark_runs(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(kernels.DEFAULT_TARGET_CONFIG, vocab_size=256, hidden_size=64,
                                   intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)))
    out = tmp_path / "k.json"
    assert kernels.main(["--config", str(cfg), "--prefixes", "40,3K", "--tree-nodes", "8", "--repeats", "1",
                         "--prefill", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["prefix"] for r in rows] == [40, 3072]
    for r in rows:
        for key in ("layer_attention_s_hybrid", "layer_attention_s_eager", "verify_s_efficient", "verify_s_eager",
                    "prefill_s_efficient", "prefill_s_eager"):
            assert r[key] > 0
    assert "| 3,072 | 8 |" in capsys.readouterr().out


def test_random_tree_is_an_ancestry_mask():
    import torch

    m = kernels.random_tree(20, torch.Generator().manual_seed(0))
    assert m.diagonal().all() and m[:, 0].all()  # every node sees itself and the root
    assert not m.triu(1).any()  # and only earlier nodes
