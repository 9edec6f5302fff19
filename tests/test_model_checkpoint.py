"""Upstream checkpoints: state dicts with the upstream names and shapes (written here from the
upstream release's parameter list, independently of the model code) load strictly and round-trip;
a wrong key or shape fails with one message that lists every problem.
"""
import json

import pytest
import torch

from megalodon_kernels.model import CheckpointMismatchError, Megalodon, get_config

REDUCED = dict(num_layers=2, model_dim=64, z_dim=32, value_dim=64, norm_num_groups=8, chunk_size=16, vocab_size=50)
PRESET_CASES = {
    # two registered presets at reduced size (their structural flags and head counts kept)
    "mega1.3B_pg19": get_config("mega1.3B_pg19", ffn_hidden_dim=56, **REDUCED),  # H=2, swiglu, tied, scale_emb
    "mega7.1B": get_config("mega7.1B", ffn_hidden_dim=88, **REDUCED),  # H=4
    # the optional-parameter flags the presets do not use
    "mega200M+rescale-noaffine": get_config("mega200M", ffn_hidden_dim=40, rescale_nffn=True, norm_affine=False,
                                            output_size=30, **REDUCED),
}


def upstream_state_dict(cfg, seed=0):
    """Random weights under upstream's names and shapes (model-parallel size 1)."""
    g = torch.Generator().manual_seed(seed)
    D, Z, E, H, Fh, N, G, V = (cfg.model_dim, cfg.z_dim, cfg.value_dim, cfg.num_heads, cfg.ffn_hidden_dim,
                               cfg.cema_ndim, cfg.norm_num_groups, cfg.vocab_size)
    Vout = V if cfg.output_size == -1 else cfg.output_size
    dz = Z // H

    def r(*shape):
        return 0.1 * torch.randn(*shape, generator=g)

    def timenorm(prefix):
        return {prefix + "prior_count": torch.tensor(0, dtype=torch.int64), prefix + "prior_mean": torch.zeros(G),
                prefix + "prior_logv": torch.zeros(G), prefix + "weight": r(D), prefix + "bias": r(D)}

    sd = {"embed.weight": r(V, D) * 3,
          "rope.freqs": torch.tensor([10000.0 ** (-j / dz) for j in range(0, dz, 2)], dtype=torch.float32)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        sd.update(timenorm(p + "mega.timenorm."))
        sd.update({
            p + "mega.cema.alpha": r(D, N, 1) * 5, p + "mega.cema.delta": r(D, N, 1) * 5,
            p + "mega.cema.theta": r(D, 1, 1) * 10, p + "mega.cema.gamma": r(D, N, 2) * 10,
            p + "mega.cema.omega": r(D, 1),
            p + "mega.wv.weight": r(E, D), p + "mega.wv.bias": r(E),
            p + "mega.wz.weight": r(Z, D), p + "mega.wz.bias": r(Z),
            p + "mega.wr.weight": r(E, D), p + "mega.wr.bias": r(E),
            p + "mega.wh1.weight": r(D, D), p + "mega.wh1.bias": r(D),
            p + "mega.wh2.weight": r(D, E),
            p + "mega.gamma": r(2, Z), p + "mega.beta": r(2, Z),
            p + "nffn.fc1.weight": r(Fh, D), p + "nffn.fc2.weight": r(D, Fh),
        })
        if cfg.norm_affine:
            sd.update({p + "mega.rmsnorm.weight": r(D), p + "nffn.norm.weight": r(D), p + "nffn.norm.bias": r(D)})
        if cfg.swiglu:
            sd[p + "nffn.fc3.weight"] = r(Fh, D)
        if cfg.rescale_nffn:
            sd[p + "nffn.alpha"] = r(D)
    sd.update(timenorm("output.final_norm."))
    sd["output.output.weight"] = sd["embed.weight"] if cfg.share_emb else r(Vout, D)
    return sd


def tokens(cfg, L=37):
    return torch.randint(0, cfg.vocab_size, (2, L), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(PRESET_CASES), ids=list(PRESET_CASES))
@torch.no_grad()
def test_upstream_state_dict_loads_strictly_and_round_trips(case):
    cfg = PRESET_CASES[case]
    sd = upstream_state_dict(cfg)
    model = Megalodon(cfg).eval()
    model.load_upstream(sd)
    out = model.state_dict()
    assert sorted(out) == sorted(sd)
    for k, v in sd.items():
        assert out[k].shape == v.shape and out[k].dtype == v.dtype and torch.equal(out[k], v), k
    logits = model(tokens(cfg))
    assert torch.isfinite(logits).all()
    # what state_dict() returns loads again (upstream names in, upstream names out)
    again = Megalodon(cfg).eval().load_upstream(out)
    assert torch.equal(again(tokens(cfg)), logits)


@torch.no_grad()
def test_from_upstream_checkpoint_directory(tmp_path):
    cfg = PRESET_CASES["mega1.3B_pg19"]
    sd = upstream_state_dict(cfg, seed=2)
    model_cfg = {**cfg.to_upstream_dict(), "vocab_size": -1}  # old checkpoints: taken from embed.weight
    (tmp_path / "config.json").write_text(json.dumps({"model": model_cfg, "tokenizer": {"path": "tok.model"}}))
    (tmp_path / "consolidate_config.json").write_text(json.dumps({"model_parallel_size": 1, "dtype": "bf16"}))
    torch.save({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()},
               tmp_path / "consolidated.pth")
    model = Megalodon.from_upstream(tmp_path).eval()
    assert model.config.vocab_size == cfg.vocab_size and model.config.swiglu and model.config.share_emb
    ref = Megalodon(cfg).eval().load_upstream({k: v.to(torch.bfloat16).float() if v.is_floating_point() else v
                                               for k, v in sd.items()})
    assert torch.equal(model(tokens(cfg)), ref(tokens(cfg)))
    # a file path and a {"model": state_dict} container work too
    torch.save({"model": sd}, tmp_path / "wrapped.pth")
    Megalodon(cfg).load_upstream(tmp_path / "wrapped.pth")


def test_wrong_keys_and_shapes_fail_with_one_useful_message():
    cfg = PRESET_CASES["mega7.1B"]
    sd = upstream_state_dict(cfg)
    sd["layers.1.mega.wz_renamed.weight"] = sd.pop("layers.1.mega.wz.weight")
    sd["layers.0.mega.cema.alpha"] = torch.zeros(cfg.model_dim, 8, 1)
    sd["layers.0.nffn.fc2.weight"] = torch.zeros(3, 3)
    del sd["output.final_norm.bias"]
    model = Megalodon(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as info:
        model.load_upstream(sd)
    msg = str(info.value)
    print(msg)
    assert "2 missing, 1 unexpected, 2 shape mismatch(es)" in msg
    assert "layers.1.mega.wz.weight  expected shape (32, 64)" in msg
    assert "output.final_norm.bias  expected shape (64,)" in msg
    assert "layers.1.mega.wz_renamed.weight  shape (32, 64)" in msg
    assert "layers.0.mega.cema.alpha: checkpoint (64, 8, 1) vs model (64, 16, 1)" in msg
    assert "layers.0.nffn.fc2.weight: checkpoint (3, 3) vs model (64, 88)" in msg
    assert "cema_ndim" in msg  # the shape hint names the config fields to compare
    assert sorted(info.value.missing) == ["layers.1.mega.wz.weight", "output.final_norm.bias"]
    # nothing was loaded
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_config_flag_and_prefix_hints():
    cfg = PRESET_CASES["mega1.3B_pg19"]  # swiglu=True
    sd = upstream_state_dict(cfg)
    with pytest.raises(CheckpointMismatchError, match="made with swiglu=True") as info:
        Megalodon(cfg.replace(swiglu=False)).load_upstream(sd)
    assert "layers.0.nffn.fc3.weight" in str(info.value)
    with pytest.raises(CheckpointMismatchError, match="made with rescale_nffn=False"):
        Megalodon(cfg.replace(rescale_nffn=True)).load_upstream(sd)
    with pytest.raises(CheckpointMismatchError, match="'module.' prefix"):
        Megalodon(cfg).load_upstream({"module." + k: v for k, v in sd.items()})
    with pytest.raises(CheckpointMismatchError, match="checkpoint has 2 layers, the config num_layers=1"):
        Megalodon(cfg.replace(num_layers=1)).load_upstream(sd)


@torch.no_grad()
def test_tied_embedding_and_rope_freqs_checks():
    cfg = PRESET_CASES["mega1.3B_pg19"]
    sd = upstream_state_dict(cfg)
    # the tied alias may be stored once
    Megalodon(cfg).load_upstream({k: v for k, v in sd.items() if k != "output.output.weight"})
    bad = dict(sd, **{"output.output.weight": sd["embed.weight"] + 1})
    with pytest.raises(CheckpointMismatchError, match="share_emb=True but output.output.weight differs"):
        Megalodon(cfg).load_upstream(bad)
    # bf16-rounded frequencies (as upstream stores them) are accepted; the rotation uses rope_base exactly
    Megalodon(cfg).load_upstream(dict(sd, **{"rope.freqs": sd["rope.freqs"].to(torch.bfloat16).float()}))
    dz = cfg.z_head_dim
    other = torch.tensor([500000.0 ** (-j / dz) for j in range(0, dz, 2)])
    with pytest.raises(CheckpointMismatchError, match=r"rope_base=500000"):
        Megalodon(cfg).load_upstream(dict(sd, **{"rope.freqs": other}))
    Megalodon(cfg.replace(rope_base=500000.0)).load_upstream(dict(sd, **{"rope.freqs": other}))


def test_model_parallel_shards_are_refused(tmp_path):
    (tmp_path / "consolidated.00.pth").write_bytes(b"")
    (tmp_path / "consolidated.01.pth").write_bytes(b"")
    with pytest.raises(ValueError, match="2 model-parallel shards"):
        Megalodon(PRESET_CASES["mega7.1B"]).load_upstream(tmp_path)
