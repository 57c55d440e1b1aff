import pytest

from seqlab import ConfigError, ModelConfig


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(d_model=100, n_heads=3), "d_model"),
        (dict(n_heads=4, n_kv_heads=3), "n_heads"),
        (dict(arch="rnn"), "arch"),
        (dict(norm="batchnorm"), "norm"),
        (dict(mlp="moe"), "mlp"),
        (dict(activation="tanh"), "activation"),
        (dict(pos="alibi"), "pos"),
        (dict(d_model=0), "d_model"),
        (dict(n_layers=-1), "n_layers"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(dropout=1.5), "dropout"),
        (dict(pad_token_id=999, vocab_size=10), "pad_token_id"),
        (dict(rope_base=-10000.0), "rope_base"),
        (dict(norm_eps=0.0), "norm_eps"),
    ],
)
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**kwargs)
    assert e.value.field == field
    assert f"ModelConfig.{field}" in str(e.value)


def test_json_round_trip(tmp_path):
    cfg = ModelConfig(arch="encoder_decoder", n_kv_heads=2, pos="learned", extra={"source": "test"})
    path = tmp_path / "config.json"
    cfg.to_json(path)
    assert ModelConfig.from_json(path) == cfg
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def test_unknown_json_field_is_named():
    with pytest.raises(ConfigError, match="n_layer"):
        ModelConfig.from_dict({"n_layer": 3})


def test_defaults_are_derived():
    cfg = ModelConfig(d_model=128, mlp="swiglu")
    assert cfg.n_kv_heads == cfg.n_heads and cfg.d_ff % 64 == 0 and cfg.activation == "silu"
    assert ModelConfig(d_model=128, mlp="gelu").d_ff == 512
