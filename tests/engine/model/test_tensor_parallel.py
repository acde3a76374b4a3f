"""Tensor parallel over two real gloo ranks (torch.multiprocessing): each rank loads only its shard of a
checkpoint, and the sharded forward's logits equal the unsharded model's (float32) on Llama (untied; tied),
Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms, tied, a vocabulary that does not divide over the ranks) and
Mistral (one KV head for two ranks: replicated), and the `tiny` preset (its weights drawn in memory, then
sharded). Each rank's KV cache holds exactly its KV heads of the
unsharded cache; the CPU kernels the unsharded model picks run on the shards; sizes that do not divide are
refused at load, naming the config field. (World size 1 is the rest of tests/engine/model/: unchanged.)

The steps run mixed batches over paged KV: two prompts' first chunks, then one's next chunk beside the
other's decode row (keeping only the rows that sample, as the runner does), then two decode rows."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from chunkwise.engine.attention import get_attention_backend
from chunkwise.engine.attention.backend import AttentionMetadata
from chunkwise.engine.datatypes.config import ModelConfig
from chunkwise.engine.distributed import ProcessGroupTP
from chunkwise.engine.model.layers import Linear
from chunkwise.engine.model.llama import LlamaForCausalLM
from chunkwise.engine.model.loader import hf_state_dict, load_model
from chunkwise.engine.worker.kv_tensors import KVTensors, kv_bytes_per_token
from tests.engine.distributed.ranks import run_ranks
from tests.hf_models import save_random_family, save_random_llama

# The shards run the kernels the CPU picks (oneDNN packed, or AVX2's small-row kernel): `make test` runs this
# again under each CHUNKWISE_CPU_ISA, which the ranks inherit.
pytestmark = pytest.mark.isa

WORLD = 2
BLOCK = 4
NUM_BLOCKS = 16
CHECKPOINTS: dict[str, Callable[[Path], Path | str]] = {
    "llama-gqa": lambda d: save_random_llama(d, "gqa"),  # 4 heads, 2 KV heads (one a rank), untied
    "llama-mha-tied": lambda d: save_random_llama(d, "mha_tied"),  # 4 KV heads, tied embeddings
    "qwen2-bias": lambda d: save_random_family(d, "qwen2-bias-yarn"),  # q/k/v biases
    "qwen3-odd-vocab": lambda d: save_random_family(d, "qwen3", vocab_size=321),  # q/k norms, tied, padded
    "mistral-1kv": lambda d: save_random_family(d, "mistral"),  # 1 KV head: each rank holds it
    "tiny-preset": lambda d: "tiny",  # a preset's tensors, sharded in memory
}


def _steps(vocab: int) -> list[list[tuple[str, list[int]]]]:
    g = torch.Generator().manual_seed(3)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    # The first and last ids of the vocabulary (one in each rank's shard) among the first chunk's.
    return [
        [("a", [0, *tokens(11), vocab - 1]), ("b", tokens(6))],
        [("a", tokens(5)), ("b", tokens(1))],
        [("a", tokens(1)), ("b", tokens(1))],
    ]


@torch.inference_mode()
def _run(model: LlamaForCausalLM, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The steps' logits, and the KV cache they leave (this rank's, through the runner's KVTensors)."""
    kv = KVTensors(
        model.config,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        num_host_blocks=0,
        dtype=torch.float32,
        device=torch.device("cpu"),
        tensor_parallel_size=world,
    )
    tables = {"a": [5, 0, 9, 2, 12, 7], "b": [3, 14, 1]}  # non-contiguous blocks
    computed = {"a": 0, "b": 0}
    logits = []
    for i, step in enumerate(_steps(model.config.vocab_size)):
        ids, positions, slots, qlens, slens = [], [], [], [], []
        for rid, toks in step:
            start = computed[rid]
            computed[rid] = end = start + len(toks)
            ids += toks
            positions += range(start, end)
            slots += [tables[rid][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
            qlens.append(len(toks))
            slens.append(end)
        width = max(len(t) for t in tables.values())
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()]),
            seq_lens=torch.tensor(slens),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables.values()]),
            slot_mapping=torch.tensor(slots),
            query_lens_host=qlens,
            seq_lens_host=slens,
            max_query_len=max(qlens),
            max_seq_len=max(slens),
            block_size=BLOCK,
        )
        # The mixed step keeps the rows that sample: a's chunk's last, b's decode row.
        keep = torch.tensor([qlens[0] - 1, qlens[0]]) if i == 1 else None
        hidden = model(torch.tensor(ids), torch.tensor(positions), kv.kv_caches, meta, keep=keep)
        logits.append(model.compute_logits(hidden))
    return logits, [c.clone() for c in kv.kv_caches]


def _describe(model: LlamaForCausalLM) -> dict[str, Any]:
    """What a rank holds (layer 0's projections' sizes, the embedding's rows) and the kernels it runs."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and "layers.1." not in n}
    return {
        "sizes": {n: (m.in_features, m.out_features) for n, m in linears.items()},
        "kernels": {n: m.kernel for n, m in linears.items()},
        "embedding_rows": model.model.embed_tokens.weight.shape[0],
        "padding": model.model.embed_tokens.weight[model.layout.vocab_rows :].clone(),
        "layout": dataclasses.asdict(model.layout),
    }


def _sharded(group: ProcessGroupTP, paths: dict[str, str], out: str) -> None:
    backend = get_attention_backend("auto", "cpu")
    results = {}
    for name, path in paths.items():
        loaded = load_model(path, dtype=torch.float32, device="cpu", backend=backend, tp_group=group)
        logits, kv = _run(loaded.model, group.world_size)
        results[name] = {"logits": logits, "kv": kv, **_describe(loaded.model)}
    torch.save(results, Path(out) / f"rank{group.rank}.pt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    return {name: str(make(root / name)) for name, make in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def unsharded(checkpoints: dict[str, str]) -> dict[str, dict[str, Any]]:
    backend = get_attention_backend("auto", "cpu")
    results = {}
    for name, path in checkpoints.items():
        loaded = load_model(path, dtype=torch.float32, device="cpu", backend=backend)
        logits, kv = _run(loaded.model, 1)
        results[name] = {"logits": logits, "kv": kv, "config": loaded.config, **_describe(loaded.model)}
    return results


@pytest.fixture(scope="module")
def ranks(checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ranks")
    run_ranks(_sharded, WORLD, checkpoints, str(out), timeout_s=120)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_sharded_logits_equal_the_unsharded_model_s(
    name: str, ranks: list[dict[str, Any]], unsharded: dict[str, dict[str, Any]]
) -> None:
    expected = unsharded[name]["logits"]
    vocab = unsharded[name]["config"].vocab_size
    for rank in ranks:
        got = rank[name]["logits"]
        assert [t.shape for t in got] == [t.shape for t in expected]
        assert all(t.shape[-1] == vocab for t in got)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    # Every rank gathers the same logits, bit for bit (the sampler may run on any).
    assert all(torch.equal(a, b) for a, b in zip(ranks[0][name]["logits"], ranks[1][name]["logits"]))


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_each_rank_s_kv_cache_holds_its_kv_heads(
    name: str, ranks: list[dict[str, Any]], unsharded: dict[str, dict[str, Any]]
) -> None:
    cfg: ModelConfig = unsharded[name]["config"]
    held = []
    for rank in ranks:
        lay = rank[name]["layout"]
        start, n = lay["kv_head_start"], lay["num_kv_heads"]
        held.append(list(range(start, start + n)))
        for got, full in zip(rank[name]["kv"], unsharded[name]["kv"]):
            assert got.shape[3] == n
            torch.testing.assert_close(got, full[:, :, :, start : start + n], rtol=1e-5, atol=1e-5)
    if cfg.num_key_value_heads < WORLD:
        assert held == [[0], [0]]  # replicated: each rank keeps the one KV head its query heads read
    else:
        assert sorted(h for heads in held for h in heads) == list(range(cfg.num_key_value_heads))


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_each_rank_holds_its_shard_and_runs_the_same_kernels(
    name: str, ranks: list[dict[str, Any]], unsharded: dict[str, dict[str, Any]]
) -> None:
    cfg: ModelConfig = unsharded[name]["config"]
    hd, h = cfg.head_dim, cfg.hidden_size
    kv_local = max(1, cfg.num_key_value_heads // WORLD)
    q_local = cfg.num_attention_heads // WORLD * hd
    vocab_shard = -(-cfg.vocab_size // WORLD)
    for rank in ranks:
        sizes = rank[name]["sizes"]
        assert sizes["model.layers.0.self_attn.qkv_proj"] == (h, q_local + 2 * kv_local * hd)
        assert sizes["model.layers.0.self_attn.o_proj"] == (q_local, h)
        assert sizes["model.layers.0.mlp.gate_up_proj"] == (h, 2 * (cfg.intermediate_size // WORLD))
        assert sizes["model.layers.0.mlp.down_proj"] == (cfg.intermediate_size // WORLD, h)
        assert sizes["lm_head"] == (h, vocab_shard)
        assert rank[name]["embedding_rows"] == vocab_shard
        # The last rank's rows past the vocabulary (qwen3-odd-vocab's one) are zeros, not memory as found.
        assert not rank[name]["padding"].any()
        assert rank[name]["kernels"] == unsharded[name]["kernels"]
    assert [len(rank[name]["padding"]) for rank in ranks] == [0, WORLD * vocab_shard - cfg.vocab_size]


def test_kv_bytes_per_token_are_a_rank_s() -> None:
    def cfg(kv: int) -> ModelConfig:
        return ModelConfig(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv,
            head_dim=16,
        )

    whole = 2 * 2 * 16 * 4  # K and V, 2 layers, head_dim 16, float32: per KV head
    assert kv_bytes_per_token(cfg(2), torch.float32) == 2 * whole
    assert kv_bytes_per_token(cfg(2), torch.float32, tensor_parallel_size=2) == whole
    assert kv_bytes_per_token(cfg(4), torch.float32, tensor_parallel_size=4) == whole
    # Fewer KV heads than ranks: each rank holds one, replicated.
    assert kv_bytes_per_token(cfg(1), torch.float32, tensor_parallel_size=2) == whole


class SilentRank:
    """Rank `rank` of a group of `world_size` that must not communicate: loading (and refusing) needs no
    collective, so one process can load any rank's shard."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("loading ran a collective")

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        raise AssertionError("loading ran a collective")


def _expected_shard(hf: str, full: torch.Tensor, cfg: ModelConfig, rank: int) -> torch.Tensor:
    """vLLM's scheme, written out per Hugging Face tensor for two ranks."""
    hd, kv = cfg.head_dim, cfg.num_key_value_heads

    def rows(t: torch.Tensor, n: int) -> torch.Tensor:  # rank's n of them
        return t[rank * n : (rank + 1) * n]

    if hf.endswith(("q_proj.weight", "q_proj.bias")):
        return rows(full, cfg.num_attention_heads // 2 * hd)
    if hf.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return full if kv == 1 else rows(full, kv // 2 * hd)  # one KV head: both ranks hold all of it
    if hf.endswith(("o_proj.weight", "down_proj.weight")):
        return rows(full.T, full.shape[1] // 2).T
    if hf.endswith(("gate_proj.weight", "up_proj.weight")):
        return rows(full, cfg.intermediate_size // 2)
    if hf.endswith(("embed_tokens.weight", "lm_head.weight")):
        return rows(full, -(-cfg.vocab_size // 2))  # the last rank's is short: its padding is no token
    return full  # norms


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("name", ["qwen2-bias", "qwen3-odd-vocab", "mistral-1kv"])
def test_each_rank_reads_its_slice_of_each_tensor(checkpoints: dict[str, str], name: str, rank: int) -> None:
    from safetensors.torch import load_file

    backend = get_attention_backend("torch", "cpu")
    loaded = load_model(
        checkpoints[name],
        dtype=torch.float32,
        device="cpu",
        backend=backend,
        prepare=False,
        tp_group=SilentRank(rank, WORLD),
    )
    full = load_file(str(Path(checkpoints[name]) / "model.safetensors"))
    got = hf_state_dict(loaded.model)
    # A tied checkpoint's lm_head is the embedding (whether or not the file holds one).
    tied = loaded.config.tie_word_embeddings
    assert got.keys() == (full.keys() - {"lm_head.weight"} if tied else full.keys())
    for hf, shard in got.items():
        assert torch.equal(shard, _expected_shard(hf, full[hf], loaded.config, rank)), hf


@pytest.mark.parametrize(
    ("edit", "world", "message"),
    [
        ({}, 3, "num_attention_heads (4) does not divide over tensor_parallel_size 3"),
        ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2, "num_key_value_heads (3) does not divide"),
        (
            {"intermediate_size": 130},
            4,
            "intermediate_size (130) does not divide over tensor_parallel_size 4",
        ),
    ],
)
def test_sizes_that_do_not_divide_are_refused_at_load(
    checkpoints: dict[str, str], tmp_path: Path, edit: dict[str, int], world: int, message: str
) -> None:
    path = shutil.copytree(checkpoints["llama-gqa"], tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text()) | edit
    (path / "config.json").write_text(json.dumps(config))
    backend = get_attention_backend("torch", "cpu")
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(
            str(path), dtype=torch.float32, device="cpu", backend=backend, tp_group=SilentRank(0, world)
        )
