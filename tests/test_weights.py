"""Weight loading: GGUF files read in place, the tokenizer's cache, HF folders, configs, errors."""
from __future__ import annotations

import json
import math
import struct

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tollway.gguf_file import GGUFFile
from tollway import checkpoint
from tollway.model_config import ModelConfig, UnsupportedModelError
from tollway.text.tokenizer import Tokenizer
from tollway.checkpoint import ModelNotFoundError
from tollway.model.weights import GGUFWeight, expected_tensor_shapes, load_weights


# --- the embedded default (Gemma 3 270M, Q4_K_M GGUF) -------------------------------------------

def test_default_model_config(default_weights):
    c = default_weights.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("gemma3", 18, 640, 2048)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (4, 1, 256, 262144)
    assert [i for i, t in enumerate(c.layer_types) if t == "full"] == [5, 11, 17]
    assert c.sliding_window == 512
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (1e6, 1e4, None)
    assert c.tie_word_embeddings and c.qk_norm and not c.attention_bias
    assert c.hidden_act == "gelu_tanh"
    assert c.attention_scale == 256 ** -0.5
    assert c.embed_scale == math.sqrt(640) and c.norm_offset == 1.0
    assert c.final_logit_softcapping is None and c.attn_logit_softcapping is None


def test_default_model_tensors(default_weights):
    tensors = default_weights.tensors
    shapes = expected_tensor_shapes(default_weights.config)
    assert tensors.keys() == shapes.keys()
    assert "lm_head.weight" not in tensors
    for name, t in tensors.items():
        assert tuple(t.shape) == shapes[name], name
        if len(shapes[name]) == 1:  # norms: float32 of our own
            assert t.dtype == torch.float32 and t.is_contiguous(), name
    assert default_weights.tokenizer_path is not None
    assert default_weights.source.suffix == ".gguf"


def test_quantized_tensors_stay_the_files_blocks_in_place(default_weights):
    """No float32 copy of a quantized tensor: each is a view of the file's memory map, at its type's
    width, and nothing of the weights is written to the cache."""
    quantized = {n: t for n, t in default_weights.tensors.items() if isinstance(t, GGUFWeight)}
    assert len(quantized) == len([s for s in expected_tensor_shapes(default_weights.config).values() if len(s) == 2])
    file_bytes = default_weights.source.stat().st_size
    assert sum(t.nbytes for t in quantized.values()) < file_bytes
    for name, t in quantized.items():
        assert not t.blocks.flags.owndata and not t.blocks.flags.writeable, name  # the map's own bytes
        block, block_bytes = gguf.GGML_QUANT_SIZES[t.gguf_type]
        assert t.blocks.shape == (t.shape[0], t.shape[1] // block * block_bytes), name
    assert {t.gguf_type.name for t in quantized.values()} >= {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    assert list(default_weights.tokenizer_path.iterdir())  # the tokenizer alone is cached
    assert not list(default_weights.tokenizer_path.glob("*.safetensors"))


def test_second_load_is_fast_and_identical(default_weights):
    again = load_weights(None)
    assert again.load_seconds < 5.0
    assert again.config == default_weights.config
    assert again.tensors.keys() == default_weights.tensors.keys()
    for name, t in default_weights.tensors.items():
        assert torch.equal(again.tensors[name].float(), t.float()), name


_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGML_TYPES = {0: ("F32", 1, 4), 6: ("Q5_0", 32, 22), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210)}


@pytest.fixture(scope="module")
def default_gguf_tensors(default_weights):
    """name -> (ggml type name, raw bytes as [rows, row bytes]), read by the GGUF v3 layout rather
    than with gguf-py, whose reader takes ~20 s on this file and is what the loader itself uses."""
    blob = np.memmap(default_weights.source, dtype=np.uint8, mode="r")

    def skip(pos: int, value_type: int) -> int:
        if value_type == 8:  # string: u64 length + bytes
            return pos + 8 + struct.unpack_from("<Q", blob, pos)[0]
        if value_type == 9:  # array: u32 element type, u64 count, elements
            element_type, count = struct.unpack_from("<IQ", blob, pos)
            pos += 12
            if element_type in _GGUF_SCALAR_BYTES:
                return pos + count * _GGUF_SCALAR_BYTES[element_type]
            for _ in range(count):
                pos = skip(pos, element_type)
            return pos
        return pos + _GGUF_SCALAR_BYTES[value_type]

    def string(pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", blob, pos)
        return bytes(blob[pos + 8:pos + 8 + length]).decode(), pos + 8 + length

    assert bytes(blob[:4]) == b"GGUF"
    _, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    pos = 24
    for _ in range(kv_count):
        key, pos = string(pos)
        assert key != "general.alignment"  # so the default alignment, 32, holds
        pos = skip(pos + 4, struct.unpack_from("<I", blob, pos)[0])
    table = []
    for _ in range(tensor_count):
        name, pos = string(pos)
        (ndim,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{ndim}Q", blob, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * ndim)
        pos += 4 + 8 * ndim + 12
        table.append((name, dims, ggml_type, offset))
    data_start = (pos + 31) // 32 * 32
    tensors = {}
    for name, dims, ggml_type, offset in table:
        type_name, block, block_bytes = _GGML_TYPES[ggml_type]
        rows, row_bytes = math.prod(dims[1:]), dims[0] // block * block_bytes  # dims run fastest-first
        start = data_start + offset
        tensors[name] = (type_name, np.asarray(blob[start:start + rows * row_bytes]).reshape(rows, row_bytes))
    return tensors


def _q8_0_reference(raw: np.ndarray, rows: int) -> np.ndarray:
    """Q8_0 by the format spec: blocks of an fp16 scale and 32 int8 values."""
    blocks = raw.reshape(-1, 34)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    return (scale * blocks[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(rows, -1)


def _q5_0_reference(raw: np.ndarray, rows: int) -> np.ndarray:
    """Q5_0 by the format spec: fp16 scale, 32 high bits, 16 bytes of low nibbles; value = d * (q - 16)."""
    blocks = raw.reshape(-1, 22)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    high = blocks[:, 2:6].copy().view(np.uint32)
    bits = (high >> np.arange(32, dtype=np.uint32)) & 1
    low = np.concatenate([blocks[:, 6:] & 0x0F, blocks[:, 6:] >> 4], axis=1).astype(np.uint32)
    return (scale * ((low | (bits << 4)).astype(np.float32) - 16)).reshape(rows, -1)


def test_dequantized_values_match_references(default_weights, default_gguf_tensors, native_library):
    """Each quantized tensor's values, as GGUFWeight.float() gives them and as the native row reader
    (the embedding's) decodes the file's blocks, equal references written apart from both."""
    from transformers.integrations.gguf.dequant import dequantize as transformers_dequantize

    converted = default_weights.tensors
    raw = default_gguf_tensors
    ids = torch.tensor([0, 1, 5, 255, 3, 0])

    def rows_read(hf_name):
        t = converted[hf_name]
        return native_library.gguf_rows(t.gguf_type.value, t.blocks, t.shape[1], ids).numpy()

    assert raw["token_embd.weight"][0] == "Q8_0"
    embed = _q8_0_reference(raw["token_embd.weight"][1], 262144)
    assert np.array_equal(converted["model.embed_tokens.weight"].float().numpy(), embed)
    assert np.array_equal(rows_read("model.embed_tokens.weight"), embed[ids])

    assert raw["blk.0.attn_k.weight"][0] == "Q5_0"
    k_proj = _q5_0_reference(raw["blk.0.attn_k.weight"][1], 256)
    assert np.array_equal(converted["model.layers.0.self_attn.k_proj.weight"].float().numpy(), k_proj)
    assert np.array_equal(rows_read("model.layers.0.self_attn.k_proj.weight"), k_proj[ids])

    # K-quants against transformers' torch dequantizer (an implementation independent of gguf-py)
    for gguf_name, hf_name, qtype in [("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight", "Q4_K"),
                                      ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", "Q6_K")]:
        type_name, data = raw[gguf_name]
        assert type_name == qtype
        ref = transformers_dequantize(torch.from_numpy(data.copy()), getattr(gguf.GGMLQuantizationType, qtype).value)
        ref = ref.reshape(converted[hf_name].shape)
        assert torch.equal(converted[hf_name].float(), ref), hf_name
        assert np.array_equal(rows_read(hf_name), ref[ids].numpy()), hf_name

    # Gemma norms are stored as 1 + w; HF (and transformers' GGUF loader) keeps w.
    for gguf_name, hf_name in [("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
                               ("blk.7.post_ffw_norm.weight", "model.layers.7.post_feedforward_layernorm.weight"),
                               ("blk.3.attn_q_norm.weight", "model.layers.3.self_attn.q_norm.weight"),
                               ("output_norm.weight", "model.norm.weight")]:
        stored = raw[gguf_name][1].view(np.float32).reshape(-1)
        assert np.array_equal(converted[hf_name].numpy(), stored - np.float32(1)), hf_name
        assert not np.allclose(stored, converted[hf_name].numpy())


# --- GGUF conversion and the cache, on a tiny llama GGUF ----------------------------------------

def _hf_tensors(folder):
    return {k: v.float() for k, v in load_file(folder / "model.safetensors").items()}


def _assert_matches_hf(loaded, hf):
    assert loaded.tensors.keys() == hf.keys()
    for name, t in hf.items():
        if name == "model.layers.0.mlp.up_proj.weight":  # stored as Q8_0
            q8 = gguf.GGMLQuantizationType.Q8_0
            t = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), q8), q8))
            assert not torch.equal(t, hf[name])
        assert torch.equal(loaded.tensors[name].float(), t), name


def test_tiny_gguf_loads_as_hf_tensors_and_caches_only_its_tokenizer(tiny_gguf, tiny_hf_models, tmp_path):
    hf = _hf_tensors(tiny_hf_models["llama"])
    first = load_weights(tiny_gguf, cache_dir=tmp_path)
    _assert_matches_hf(first, hf)  # q/k equal only if llama.cpp's rotary permutation was undone
    assert isinstance(first.tensors["model.layers.0.mlp.up_proj.weight"], GGUFWeight)
    hf_config = ModelConfig.from_hf_config(json.loads((tiny_hf_models["llama"] / "config.json").read_text()))
    assert first.config.to_dict() | {"rms_norm_eps": 1e-6} == hf_config.to_dict()

    second = load_weights(tiny_gguf, cache_dir=tmp_path)
    assert second.config == first.config and second.tokenizer_path == first.tokenizer_path
    _assert_matches_hf(second, hf)
    assert (second.tokenizer_path / "tokenizer.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [second.tokenizer_path.name]  # no temp folders left


def test_cache_dir_from_environment(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("TOLLWAY_CACHE", str(tmp_path / "env"))
    loaded = load_weights(tiny_gguf)
    assert loaded.tokenizer_path.parent == tmp_path / "env"
    explicit = load_weights(tiny_gguf, cache_dir=tmp_path / "arg")
    assert explicit.tokenizer_path.parent == tmp_path / "arg"


def test_a_tokenizer_converted_now_is_handed_out_once_as_built_then_read_from_its_files(tiny_gguf, tmp_path):
    loaded = load_weights(tiny_gguf, cache_dir=tmp_path)
    folder, built = loaded.tokenizer_source()
    assert built is not None and (folder / "tokenizer.json").is_file()
    first = loaded.load_tokenizer()
    assert first._backend.hf is built and loaded.tokenizer_source() == (folder, None)
    second = loaded.load_tokenizer()  # another engine's: its own, parsed from the files written
    assert second._backend.hf is not built
    text = "hello world, a test"
    assert first.encode(text) == second.encode(text) and first.eos_token_ids == second.eos_token_ids
    assert load_weights(tiny_gguf, cache_dir=tmp_path).tokenizer_source() == (folder, None)  # cached now


def test_interrupted_tokenizer_conversion_leaves_no_cache(tiny_gguf, tmp_path, monkeypatch):
    def fail(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_gguf_tokenizer", fail)
    loaded = load_weights(tiny_gguf, cache_dir=tmp_path)  # converts when first asked for its tokenizer
    with pytest.raises(KeyboardInterrupt):
        loaded.tokenizer_path
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert (load_weights(tiny_gguf, cache_dir=tmp_path).tokenizer_path / "tokenizer.json").is_file()


def test_the_tokenizer_is_cached_by_its_own_bytes_in_the_file(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    first = load_weights(tiny_gguf, cache_dir=cache).tokenizer_path
    # Another file with the same tokenizer (another size of one family) shares its conversion.
    copy = tmp_path / "other-size.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    assert load_weights(copy, cache_dir=cache).tokenizer_path == first
    # The longest token respelled in as many bytes: a new conversion, which has the new token.
    tokens = GGUFFile(tiny_gguf).metadata["tokenizer.ggml.tokens"]
    token = max(tokens, key=len).encode()
    respelled = "Q" * len(token)
    copy.write_bytes(tiny_gguf.read_bytes().replace(len(token).to_bytes(8, "little") + token,
                                                    len(token).to_bytes(8, "little") + respelled.encode()))
    changed = load_weights(copy, cache_dir=cache).tokenizer_path
    assert changed != first and sorted(p.name for p in cache.iterdir()) == sorted([first.name, changed.name])
    for folder, has in ((first, False), (changed, True)):
        tokenizer = Tokenizer.load(folder)
        assert any(respelled in tokenizer.decode([i]) for i in range(len(tokens))) == has


def _write_gguf(path, arch: str, rope_freqs: np.ndarray | None = None) -> None:
    """A metadata-only GGUF with just an embedding (and rope_freqs): enough for ModelConfig."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((10, 32), dtype=np.float32))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_rope_freqs_become_freq_factors(tmp_path):
    factors = np.array([1.0, 1.0, 2.5, 8.0, 8.0, 8.0, 8.0, 8.0], dtype=np.float32)
    _write_gguf(tmp_path / "m.gguf", "llama", factors)
    config = ModelConfig.from_gguf(GGUFFile(tmp_path / "m.gguf"))
    assert config.rope_scaling == {"rope_type": "freq_factors", "factors": factors.tolist()}
    assert (config.head_dim, config.num_kv_heads, config.vocab_size) == (16, 2, 10)


# --- HF folders -------------------------------------------------------------------------------

def test_hf_folders_load_with_canonical_names(tiny_hf_models):
    for name, folder in tiny_hf_models.items():
        loaded = load_weights(folder)
        config = loaded.config
        assert loaded.tokenizer_path is None and loaded.source == folder.resolve()
        assert loaded.tensors.keys() == expected_tensor_shapes(config).keys(), name
        for key, t in _hf_tensors(folder).items():
            assert loaded.tensors[key].dtype == torch.float32
            assert torch.equal(loaded.tensors[key], t), (name, key)

    configs = {name: load_weights(folder).config for name, folder in tiny_hf_models.items()}
    assert [c.architecture for c in configs.values()] == ["llama", "llama", "llama", "gemma3"]
    assert configs["qwen2"].attention_bias and not configs["qwen2"].qk_norm
    assert configs["qwen3"].qk_norm and configs["qwen3"].tie_word_embeddings
    assert not configs["llama"].qk_norm and not configs["llama"].tie_word_embeddings
    gemma = configs["gemma3"]
    assert gemma.layer_types == ["sliding", "full"] and gemma.sliding_window == 8
    assert (gemma.rope_theta, gemma.rope_local_theta, gemma.attention_scale) == (1e6, 1e4, 0.25)
    assert gemma.embed_scale == 8.0 and gemma.norm_offset == 1.0


def test_sharded_hf_folder(tiny_hf_models, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hf_models["llama"])
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_weights(tmp_path)
    for key, t in _hf_tensors(tiny_hf_models["llama"]).items():
        assert torch.equal(loaded.tensors[key], t), key


def test_multimodal_gemma3_names_map_to_the_text_model(tiny_hf_models, tmp_path):
    from safetensors.torch import save_file

    text = load_file(tiny_hf_models["gemma3"] / "model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in text.items()}
    renamed["model.vision_tower.patch_embedding.weight"] = torch.zeros(2, 2)
    save_file(renamed, tmp_path / "model.safetensors")
    text_config = json.loads((tiny_hf_models["gemma3"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text_config}))
    loaded = load_weights(tmp_path)
    assert loaded.tensors.keys() == {k for k in text}
    assert loaded.config == load_weights(tiny_hf_models["gemma3"]).config


# --- errors -----------------------------------------------------------------------------------

def test_missing_model_raises_model_not_found(tmp_path):
    for model in [tmp_path / "nope.gguf", "no-such-model", tmp_path]:
        with pytest.raises(ModelNotFoundError) as info:
            load_weights(model)
        assert "\n" not in str(info.value) and str(model) in str(info.value)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match=r"'bert'.*gemma3.*llama.*qwen3"):
        load_weights(tmp_path)

    _write_gguf(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(UnsupportedModelError, match="'phi3'"):
        load_weights(tmp_path / "phi.gguf", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_weights_that_do_not_fit_the_config_are_rejected(tiny_hf_models, tmp_path):
    config = json.loads((tiny_hf_models["llama"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3}))
    (tmp_path / "model.safetensors").symlink_to(tiny_hf_models["llama"] / "model.safetensors")
    with pytest.raises(ValueError, match="missing.*model.layers.2"):
        load_weights(tmp_path)


# --- configs from config.json spellings in the wild -------------------------------------------

def test_config_from_legacy_llama3_rope_spelling():
    config = ModelConfig.from_hf_config({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    })
    assert config.rope_theta == 500000.0 and config.head_dim == 64
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                                   "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}


def test_config_sliding_windows_of_qwen_and_mistral():
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "max_position_embeddings": 4096}
    qwen = ModelConfig.from_hf_config(base | {"model_type": "qwen2", "sliding_window": 131072, "use_sliding_window": False})
    assert qwen.sliding_window is None and qwen.layer_types == ["full"] * 4 and qwen.attention_bias
    qwen_swa = ModelConfig.from_hf_config(base | {"model_type": "qwen2", "sliding_window": 1024,
                                                  "use_sliding_window": True, "max_window_layers": 2})
    assert qwen_swa.layer_types == ["full", "full", "sliding", "sliding"]
    mistral = ModelConfig.from_hf_config(base | {"model_type": "mistral", "sliding_window": 4096})
    assert mistral.layer_types == ["sliding"] * 4 and mistral.num_kv_heads == 4


def test_config_from_multimodal_gemma3_with_sparse_text_config():
    config = ModelConfig.from_hf_config({
        "model_type": "gemma3",
        "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                        "num_hidden_layers": 34, "sliding_window": 1024,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
    })
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (8, 4, 256, 262208)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0} and config.rope_local_theta == 10000.0
    assert config.layer_types[:6] == ["sliding"] * 5 + ["full"] and config.tie_word_embeddings


def test_config_round_trips_through_dict(default_weights):
    config = default_weights.config
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
