"""chunkwise's Llama against Hugging Face transformers on random checkpoints saved to disk."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from chunkwise.engine import kernels as chunkwise_kernels
from chunkwise.engine.attention.backend import AttentionMetadata, kv_cache_shape
from chunkwise.engine.attention.torch_ref import TorchAttentionBackend
from chunkwise.engine.datatypes.config import ModelConfig
from chunkwise.engine.hardware import cpu_has_avx512
from chunkwise.engine.model import PRESETS, LoadedModel, load_model
from chunkwise.engine.model.layers import Linear, onednn_bf16_available
from chunkwise.engine.model.llama import LlamaForCausalLM as ChunkwiseLlama
from chunkwise.engine.model.loader import hf_state_dict
from chunkwise.engine.tokenizer import ByteTokenizer

# Its expectations depend on the CPU's choices: `make test` runs it again under each CHUNKWISE_CPU_ISA.
pytestmark = pytest.mark.isa

BLOCK_SIZE = 4


class PagedRequests:
    """Just enough of a KV cache manager: random non-contiguous blocks per request, flat batches."""

    def __init__(self, config: ModelConfig, num_blocks: int = 128, seed: int = 0, dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        shape = kv_cache_shape(num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]

    def batch(
        self, chunks: list[tuple[str, list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids, positions, slots, tables, qlens, slens = [], [], [], [], [], []
        for rid, tokens in chunks:
            table = self.tables.setdefault(rid, [])
            start = self.computed.get(rid, 0)
            end = start + len(tokens)
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            for p in range(start, end):
                slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            ids += tokens
            positions += range(start, end)
            tables.append(table)
            qlens.append(len(tokens))
            slens.append(end)
            self.computed[rid] = end
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()]),
            seq_lens=torch.tensor(slens),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            slot_mapping=torch.tensor(slots),
            query_lens_host=qlens,
            seq_lens_host=slens,
            max_query_len=max(qlens),
            max_seq_len=max(slens),
            block_size=BLOCK_SIZE,
        )
        return torch.tensor(ids), torch.tensor(positions), meta


def _randomize_extras(model: torch.nn.Module, seed: int) -> None:
    """HF initialises norms to 1 and biases to 0; make them random so loading them is tested too."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


COMMON = dict(
    vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=2, max_position_embeddings=256
)
HF_MODELS = {
    "llama-gqa": (LlamaForCausalLM, LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2)),
    "llama-mha-tied-theta": (
        LlamaForCausalLM,
        LlamaConfig(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_theta=500000.0,
        ),
    ),
    "llama-gqa4-headdim": (
        LlamaForCausalLM,
        LlamaConfig(
            **COMMON,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            rope_theta=1000.0,
            rms_norm_eps=1e-5,
        ),
    ),
    "qwen2-bias": (
        Qwen2ForCausalLM,
        Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0),
    ),
    "mistral": (
        MistralForCausalLM,
        MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1, sliding_window=None),
    ),
}


@pytest.fixture(scope="module", params=sorted(HF_MODELS))
def hf_pair(request, tmp_path_factory):
    cls, cfg = HF_MODELS[request.param]
    torch.manual_seed(0)
    cfg._attn_implementation = "eager"
    hf = cls(cfg).eval()
    _randomize_extras(hf, seed=1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    loaded = load_model(str(path), dtype=torch.float32, device="cpu", backend=TorchAttentionBackend())
    return hf, loaded


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


PROMPT = [256, *range(40, 77)]  # 38 tokens: several blocks, not a multiple of the block size


def test_full_prompt_logits_match_hf(hf_pair):
    hf, loaded = hf_pair
    paged = PagedRequests(loaded.config)
    ids, pos, meta = paged.batch([("a", PROMPT)])
    with torch.no_grad():
        logits = loaded.model.compute_logits(loaded.model(ids, pos, paged.kv_caches, meta))
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_then_decode_matches_hf(hf_pair):
    hf, loaded = hf_pair
    paged = PagedRequests(loaded.config, seed=3)
    model = loaded.model
    last = None
    with torch.no_grad():
        for chunk in (PROMPT[:5], PROMPT[5:12], PROMPT[12:13], PROMPT[13:]):
            ids, pos, meta = paged.batch([("a", chunk)])
            last = model.compute_logits(model(ids, pos, paged.kv_caches, meta)[-1:])
        assert last is not None
        torch.testing.assert_close(last[0], hf_logits(hf, PROMPT)[-1], atol=1e-4, rtol=1e-4)
        # Two greedy decode steps on the paged cache.
        seq = list(PROMPT)
        for _ in range(2):
            seq.append(int(last.argmax()))
            ids, pos, meta = paged.batch([("a", seq[-1:])])
            last = model.compute_logits(model(ids, pos, paged.kv_caches, meta))
        torch.testing.assert_close(last[0], hf_logits(hf, seq)[-1], atol=1e-4, rtol=1e-4)


def test_mixed_batch_prefill_chunk_and_decode_row(hf_pair):
    hf, loaded = hf_pair
    paged = PagedRequests(loaded.config, seed=5)
    model = loaded.model
    prompt_b = [256, *range(120, 150)]
    with torch.no_grad():
        # Step 1: A's whole prompt and B's first chunk.
        ids, pos, meta = paged.batch([("a", PROMPT), ("b", prompt_b[:9])])
        hidden = model(ids, pos, paged.kv_caches, meta)
        next_a = int(model.compute_logits(hidden[len(PROMPT) - 1 : len(PROMPT)]).argmax())
        # Step 2: B's second chunk, then A's decode row, in one flat batch.
        ids, pos, meta = paged.batch([("b", prompt_b[9:]), ("a", [next_a])])
        hidden = model(ids, pos, paged.kv_caches, meta)
        logits = model.compute_logits(hidden)
    torch.testing.assert_close(logits[: len(prompt_b) - 9], hf_logits(hf, prompt_b)[9:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[-1], hf_logits(hf, [*PROMPT, next_a])[-1], atol=1e-4, rtol=1e-4)


def test_half_precision_tracks_fp32(hf_pair, tmp_path):
    hf, _ = hf_pair
    path = Path(tmp_path) / "ckpt"
    hf.save_pretrained(path)
    half = load_model(str(path), dtype=torch.bfloat16, device="cpu", backend=TorchAttentionBackend())
    # Linear weights may be widened for the CPU's matmul library (Linear.prepare); the rest stays bf16.
    assert all(
        p.dtype == torch.bfloat16
        for n, p in half.model.named_parameters()
        if "proj" not in n and "lm_head" not in n
    )
    paged = PagedRequests(half.config, dtype=torch.bfloat16)
    ids, pos, meta = paged.batch([("a", PROMPT)])
    with torch.no_grad():
        logits = half.model.compute_logits(half.model(ids, pos, paged.kv_caches, meta))
    assert logits.dtype == torch.float32
    ref = hf_logits(hf, PROMPT)
    assert torch.isfinite(logits).all()
    assert (logits - ref).abs().max() < 0.05 * ref.abs().max() + 0.05


def test_tied_embeddings_share_one_tensor(hf_pair, tmp_path):
    hf, prepared = hf_pair
    hf.save_pretrained(tmp_path)
    loaded = load_model(
        str(tmp_path), dtype=torch.float32, device="cpu", backend=TorchAttentionBackend(), prepare=False
    )
    model = loaded.model
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == loaded.config.tie_word_embeddings
    # Prepared for the CPU's matmul library, a tied lm_head gets its own copy in that layout: the same map.
    hidden = torch.randn(3, loaded.config.hidden_size)
    torch.testing.assert_close(prepared.model.compute_logits(hidden), model.compute_logits(hidden))


def test_hf_state_dict_keys_are_hf_names():
    config = PRESETS["tiny"]
    with torch.device("meta"):
        model = ChunkwiseLlama(config, TorchAttentionBackend())
    keys = set(hf_state_dict(model))
    assert "model.embed_tokens.weight" in keys
    assert "lm_head.weight" in keys
    for i in range(config.num_hidden_layers):
        for sub in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"):
            assert f"model.layers.{i}.{sub}.weight" in keys
        for sub in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            assert f"model.layers.{i}.{sub}.weight" in keys
        assert f"model.layers.{i}.input_layernorm.weight" in keys
        assert f"model.layers.{i}.post_attention_layernorm.weight" in keys
    assert "model.norm.weight" in keys


# ---------------------------------------------------------------- presets


def _longest_run(tokens: list[int]) -> int:
    best = run = 1
    for a, b in itertools.pairwise(tokens):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return best


def _greedy(loaded: LoadedModel, prompt: str, steps: int) -> list[int]:
    paged = PagedRequests(loaded.config, num_blocks=math.ceil((len(prompt) + steps + 2) / BLOCK_SIZE) + 1)
    out: list[int] = []
    chunk = ByteTokenizer().encode(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids, pos, meta = paged.batch([("a", chunk)])
            logits = loaded.model.compute_logits(loaded.model(ids, pos, paged.kv_caches, meta)[-1:])
            chunk = [int(logits.argmax())]
            out.append(chunk[0])
    return out


@pytest.mark.parametrize(("name", "steps"), [("tiny", 128), ("small", 32)])
def test_preset_greedy_output_does_not_get_stuck(name, steps):
    loaded = load_model(name, dtype=torch.float32, device="cpu", backend=TorchAttentionBackend())
    for prompt in ("Hello, world! The quick brown fox", "1234567890"):
        out = _greedy(loaded, prompt, steps)
        assert _longest_run(out) < 12, out
        assert len(set(out)) >= steps // 8, out


def test_presets_are_deterministic_and_sized():
    backend = TorchAttentionBackend()
    a = load_model("tiny", dtype=torch.float32, device="cpu", backend=backend, prepare=False)
    b = load_model("tiny", dtype=torch.float32, device="cpu", backend=backend, prepare=False)
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), name
    # The byte tokenizer's every id has an embedding, and nothing more.
    assert a.config.vocab_size == ByteTokenizer().vocab_size == a.tokenizer.vocab_size
    assert a.config.eos_token_ids == a.tokenizer.eos_token_ids
    for config in PRESETS.values():
        assert config.max_position_embeddings >= 4096
    with torch.device("meta"):
        small = ChunkwiseLlama(PRESETS["small"], backend)
    n_params = sum(p.numel() for p in small.parameters())
    assert 50e6 <= n_params <= 60e6, n_params
    half = load_model("tiny", dtype=torch.float16, device="cpu", backend=backend, prepare=False)
    for (name, pa), (_, ph) in zip(a.model.named_parameters(), half.model.named_parameters()):
        assert ph.dtype == torch.float16
        assert torch.equal(pa.half(), ph), name


def _two_step_logits(loaded: LoadedModel, dtype: torch.dtype) -> torch.Tensor:
    paged = PagedRequests(loaded.config, dtype=dtype)
    with torch.no_grad():
        ids, pos, meta = paged.batch([("a", PROMPT), ("b", PROMPT[:9])])
        loaded.model(ids, pos, paged.kv_caches, meta)
        ids, pos, meta = paged.batch([("a", [7]), ("b", PROMPT[9:20])])
        return loaded.model.compute_logits(loaded.model(ids, pos, paged.kv_caches, meta))


@pytest.mark.parametrize(
    ("dtype", "widen"), [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)]
)
def test_prepared_model_computes_what_the_plain_one_does(dtype, widen):
    """prepare() changes how layers run (oneDNN layouts, fused CPU kernels), not what they compute. Both bf16
    paths run on every CPU: widened to float32 (the choice where the CPU lacks bf16 units) and kept bf16."""
    backend = TorchAttentionBackend()
    plain = load_model("small", dtype=dtype, device="cpu", backend=backend, prepare=False)
    fast = load_model("small", dtype=dtype, device="cpu", backend=backend, prepare=False)
    fast.model.prepare(widen_half_on_cpu=widen)
    kernels = {m.kernel for m in fast.model.modules() if isinstance(m, Linear)}
    # float32 always, bf16 when widened: packed for oneDNN with AVX-512, else the small-row kernel on x86.
    expected = "small-m+onednn" if chunkwise_kernels.isa() in ("avx2", "avx512") else "onednn"
    if cpu_has_avx512() or (dtype != torch.float32 and not widen):
        expected = "onednn-packed"  # oneDNN over its own layout of the weight
    if dtype != torch.float32 and not widen and not onednn_bf16_available():
        expected = "torch"  # a CPU whose oneDNN refuses bf16 (AVX2): torch's own bf16 GEMM
    assert kernels == {expected}, kernels
    got, want = _two_step_logits(fast, dtype), _two_step_logits(plain, dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        return
    # bf16 through 14 layers: rounding differs with accumulation order, so compare both with float32.
    # The prepared path (fp32 accumulation, as a bf16 GEMM does) must be at least as close as torch's own.
    exact = _two_step_logits(
        load_model("small", dtype=torch.float32, device="cpu", backend=backend), torch.float32
    )

    def err(x: torch.Tensor) -> float:
        return float((x - exact).norm() / exact.norm())

    assert err(got) < 0.05 and err(got) <= 1.25 * err(want), (err(got), err(want))
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("keep_rows", [[], [3], [len(PROMPT) - 1, len(PROMPT) + 8], [0, 5, 2]])
def test_keep_computes_the_kept_rows_and_every_rows_cache(keep_rows):
    """With `keep`, the last layer goes on past attention for those rows only: their hidden states are the
    full forward's (in keep's order), and every row's keys and values still reach the cache, so the next
    step computes what it would have."""
    backend = TorchAttentionBackend()
    loaded = load_model("tiny", dtype=torch.float32, device="cpu", backend=backend)
    results = []
    for keep in (None, torch.tensor(keep_rows, dtype=torch.long)):
        paged = PagedRequests(loaded.config)
        with torch.no_grad():
            ids, pos, meta = paged.batch([("a", PROMPT), ("b", PROMPT[:9])])
            first = loaded.model(ids, pos, paged.kv_caches, meta, keep=keep)
            ids, pos, meta = paged.batch([("a", [7]), ("b", PROMPT[9:20])])
            second = loaded.model(ids, pos, paged.kv_caches, meta)
        results.append((first, second, [c.clone() for c in paged.kv_caches]))
    (full, next_full, caches_full), (kept, next_kept, caches_kept) = results
    assert kept.shape == (len(keep_rows), loaded.config.hidden_size)
    torch.testing.assert_close(kept, full[keep_rows], atol=1e-5, rtol=1e-5)
    for a, b in zip(caches_full, caches_kept):
        assert torch.equal(a, b)
    assert torch.equal(next_full, next_kept)


def test_a_tied_head_packed_for_bf16_keeps_the_embedding_plain(hf_pair, tmp_path):
    """bf16 on a CPU with bf16 units: each Linear's weight is replaced by oneDNN's packed copy. A tied head
    gets its own; the embedding the lookups read must stay a plain tensor, and both compute what they did."""
    hf, _ = hf_pair
    hf.save_pretrained(tmp_path)
    backend = TorchAttentionBackend()
    plain = load_model(str(tmp_path), dtype=torch.bfloat16, device="cpu", backend=backend, prepare=False)
    packed = load_model(str(tmp_path), dtype=torch.bfloat16, device="cpu", backend=backend, prepare=False)
    packed.model.prepare(widen_half_on_cpu=False)
    linears = [m for m in packed.model.modules() if isinstance(m, Linear)]
    if onednn_bf16_available():
        assert {m.kernel for m in linears} == {"onednn-packed"}
        assert all(m.weight.is_mkldnn for m in linears)
    else:  # an AVX2 CPU's oneDNN refuses bf16: torch's GEMM, weights as loaded
        assert {m.kernel for m in linears} == {"torch"}
    embedding = packed.model.model.embed_tokens.weight
    assert not embedding.is_mkldnn and torch.equal(embedding, plain.model.model.embed_tokens.weight)
    hidden = torch.randn(5, plain.config.hidden_size).bfloat16()
    torch.testing.assert_close(
        packed.model.compute_logits(hidden), plain.model.compute_logits(hidden), atol=2e-2, rtol=2e-2
    )
