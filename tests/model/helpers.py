"""Small random configurations shared by the core tests."""

from seqlab import ModelConfig

LLAMA = dict(arch="decoder", vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, pos="rope",
             norm="rmsnorm", mlp="swiglu", max_seq_len=64)
GPT2 = dict(arch="decoder", vocab_size=97, d_model=64, n_layers=2, n_heads=4, pos="learned", norm="layernorm",
            mlp="gelu", activation="gelu_tanh", bias=True, max_seq_len=64)
SINUS = dict(GPT2, pos="sinusoidal", pre_norm=False)
BERT = dict(arch="encoder", vocab_size=97, d_model=64, n_layers=2, n_heads=4, pos="learned", norm="layernorm",
            mlp="gelu", bias=True, pre_norm=False, embed_norm=True, mlm_head_transform=True, lm_head_bias=True,
            type_vocab_size=2, max_seq_len=64)
BART = dict(arch="encoder_decoder", vocab_size=97, d_model=64, n_layers=2, n_decoder_layers=2, n_heads=4,
            pos="learned", pos_offset=2, norm="layernorm", mlp="gelu", bias=True, pre_norm=False, embed_norm=True,
            lm_head_bias=True, max_seq_len=64)
T5ISH = dict(arch="encoder_decoder", vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, pos="rope",
             norm="rmsnorm", mlp="swiglu", max_seq_len=64)

DECODERS = {"llama": LLAMA, "gpt2": GPT2, "sinusoidal_postnorm": SINUS}


def cfg(base: dict, **kw) -> ModelConfig:
    return ModelConfig(**{**base, **kw})
