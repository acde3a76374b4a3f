"""The Llama architecture (also Mistral, Qwen2 and Qwen3, which differ only in config), over a flat batch.

There is no batch dimension and no padding: a step's tokens from every request are concatenated, and the
attention backend uses the step's plan to keep requests apart. q/k/v and gate/up are each one matmul over
weights fused at load time (each fused Linear names the Hugging Face projections stacked into it).

Tensor parallel (vLLM's scheme; a TPGroup of more than one rank, distributed/layout.py for the shares): each
rank holds its query heads' share of q/k/v (with its KV heads, replicated where there are fewer KV heads than
ranks) and of gate/up, o_proj's and down_proj's matching input columns, and its rows of the vocabulary. Each
layer sums o_proj's and down_proj's partial outputs over the ranks (one all_reduce each), the embedding sums
its shards' rows, and the logits are the ranks' shards gathered. At world size 1 (the default) none of that
communicates: the model is the unsharded one.

Pipeline parallel (a PipelineStage of more than one stage, distributed/pipeline.py): a stage holds its
consecutive layers (the others are MissingLayer placeholders, so that parameter names stay Hugging Face's),
the first stage the embedding, the last the final norm and the LM head (and the embedding too when the LM
head is tied to it: the tied tensor is the embedding's). A stage after the first receives the hidden states
and residual stream of the one before; a stage before the last sends them on and returns a placeholder with
no features, one row per row the model would have returned; on global rank 0 compute_logits receives the
logits the last stage computed for those rows (in the same order: every rank makes the same calls).
"""

from __future__ import annotations

import torch
from torch import nn

from chunkwise.engine.attention.backend import AttentionBackend, AttentionMetadata, AttentionPlan
from chunkwise.engine.datatypes.config import ModelConfig
from chunkwise.engine.distributed import SINGLE_RANK, PipelineStage, TPGroup, TPLayout, single_stage
from chunkwise.engine.lora.rows import LoRARows, LoRAStep
from chunkwise.engine.lora.slots import LoRASlots, Target
from chunkwise.engine.model.layers import Linear, Part, RMSNorm, Rope, RotaryEmbedding, SiluAndMul
from chunkwise.engine.model.parallel import VocabParallelEmbedding


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        layout: TPLayout,
        tp: TPGroup,
    ) -> None:
        super().__init__()
        # This rank's heads: all of them at world size 1.
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = hd = config.head_dim
        self.q_size = self.num_heads * hd
        self.kv_size = self.num_kv_heads * hd
        self.scale = hd**-0.5
        self.backend = backend
        self.rotary = rotary
        self.tp = tp
        q_total, kv_total = config.num_attention_heads * hd, config.num_key_value_heads * hd
        kv_start = layout.kv_head_start * hd
        # Qwen2 puts a bias on q/k/v only (sharded with their rows); o_proj never has one in the families we
        # load, so its partial sums need no bias added once.
        self.qkv_proj = Linear(
            config.hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=config.attention_bias,
            parts=(
                Part("q_proj", self.q_size, layout.head_start * hd, q_total),
                Part("k_proj", self.kv_size, kv_start, kv_total),
                Part("v_proj", self.kv_size, kv_start, kv_total),
            ),
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, columns=(layout.head_start * hd, q_total))
        # Qwen3 normalises each head's query and key (over head_dim) before rotating them.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
        keep: torch.Tensor | None = None,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x, lora.rows if lora else None)
        # q and k sit side by side in the fused output: one rotation covers both.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat(
                (self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1
            )
        qk = self.rotary.apply(qk, rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        # Write first: a prefill chunk attends to its own keys through the cache, like everything else.
        self.backend.write_kv(k, v, kv_cache, plan.meta.slot_mapping)
        o = self.backend.attend(q, kv_cache, plan, self.scale).reshape(t, self.q_size)
        # Row parallel: each rank's heads' share of the projection, summed over the ranks.
        kept = lora.kept if lora else None
        return self.tp.all_reduce(self.o_proj(o if keep is None else o.index_select(0, keep), kept))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layout: TPLayout, tp: TPGroup) -> None:
        super().__init__()
        size, start, total = layout.intermediate_size, layout.intermediate_start, config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size,
            2 * size,
            parts=(Part("gate_proj", size, start, total), Part("up_proj", size, start, total)),
        )
        self.act = SiluAndMul()
        self.down_proj = Linear(size, config.hidden_size, columns=(start, total))
        self.tp = tp

    def forward(self, x: torch.Tensor, lora: LoRARows | None = None) -> torch.Tensor:
        # Row parallel, as o_proj: this rank's intermediate columns' share, summed over the ranks.
        return self.tp.all_reduce(self.down_proj(self.act(self.gate_up_proj(x, lora)), lora))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        layout: TPLayout,
        tp: TPGroup,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend, rotary, layout, tp)
        self.mlp = MLP(config, layout, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
        keep: torch.Tensor | None = None,
        lora: LoRAStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream before it): the layer's output is their sum, which the next layer's
        norm adds (or the model's final norm), so that each residual add is fused with the norm after it
        (one launch on a GPU, model/triton_ops.py). The first layer gets residual None and x the embeddings.

        keep: the rows to go on past attention (see LlamaModel.forward); every row's keys and values are
        written either way."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add(x, residual)
        attn = self.self_attn(h, rope, kv_cache, plan, keep, lora)
        if keep is not None:
            residual = residual.index_select(0, keep)
        residual, h = self.post_attention_layernorm.add(attn, residual)
        return self.mlp(h, lora.kept if lora else None), residual


class MissingLayer(nn.Module):
    """Another pipeline stage's layer: no parameters, never called (it keeps the layer indices, and so the
    parameter names, of the layers this stage holds)."""


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        tp: TPGroup = SINGLE_RANK,
        pp: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        # What this rank holds; refuses (ValueError naming the field) sizes that do not divide.
        self.layout = layout = TPLayout.of(config, tp.rank, tp.world_size)
        self.pp = pp = pp if pp is not None else single_stage(config.num_hidden_layers)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        holds_embedding = pp.is_first or (pp.is_last and config.tie_word_embeddings)
        self.embed_tokens = (
            VocabParallelEmbedding(layout, config.hidden_size, tp) if holds_embedding else None
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, self.rotary, layout, tp) if i in pp.layers else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else None

    def first_layer(self) -> DecoderLayer:
        """This stage's first layer (its weights have the model's dtype and device)."""
        layer = self.layers[self.pp.layers.start]
        assert isinstance(layer, DecoderLayer)
        return layer

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        plan: AttentionPlan | None = None,
        keep: torch.Tensor | None = None,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden], or [len(keep), hidden] for the token rows `keep` lists.

        Only the rows a step samples or scores need the last layer's output; the rest of a prefill chunk
        needs only its keys and values in the cache. With `keep`, the last layer computes its output
        projection and MLP for those rows alone: most of a layer's work for a prompt token.

        A pipeline stage before the last returns a [rows, 0] placeholder (see the module's docstring)."""
        own = self.pp.layers
        if len(kv_caches) != len(own):
            raise ValueError(
                f"expected {len(own)} KV caches (one per layer of this stage), got {len(kv_caches)}"
            )
        # The backend plans the step once (which rows take which path, their index tensors); every layer
        # reuses the plan. A runner may have built it already, outside a captured graph.
        if plan is None:
            heads = self.layout
            plan = self.backend.plan(meta, heads.num_heads, heads.num_kv_heads, self.config.head_dim)
        residual: torch.Tensor | None = None
        if self.pp.is_first:
            assert self.embed_tokens is not None
            x = self.embed_tokens(input_ids)
        else:
            like = self.first_layer().input_layernorm.weight
            x, residual = self.pp.recv_hidden(
                input_ids.shape[0], self.config.hidden_size, like.dtype, like.device
            )
        rope = self.rotary.lookup(positions, x.dtype)
        last = self.config.num_hidden_layers - 1
        # Before the last layer every row goes on: its adapters' rows are the step's rows throughout.
        every = LoRAStep(lora.rows, lora.rows) if lora is not None else None
        for i, kv_cache in zip(own, kv_caches):
            if i == last:
                x, residual = self.layers[i](x, residual, rope, kv_cache, plan, keep, lora)
            else:
                x, residual = self.layers[i](x, residual, rope, kv_cache, plan, None, every)
        assert residual is not None  # a stage has a layer
        if self.norm is None:
            self.pp.send_hidden(x, residual)
            return x.new_empty((x.shape[0] if keep is None else keep.shape[0], 0))
        return self.norm.add(x, residual)[1]


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        tp: TPGroup = SINGLE_RANK,
        pp: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, backend, tp, pp)
        # This rank's stage: its layers (all of them at pipeline size 1), its KV caches one per layer.
        self.pp = self.model.pp
        # This rank's heads and shares (everything at world size 1): its KV cache holds layout.num_kv_heads.
        self.layout = layout = self.model.layout
        # Column parallel over the vocabulary, its rows the embedding's (so tying shares the shard); the last
        # pipeline stage's only.
        self.lm_head = (
            Linear(
                config.hidden_size,
                layout.vocab_shard,
                parts=(Part("", layout.vocab_rows, layout.vocab_start, config.vocab_size),),
            )
            if self.pp.is_last
            else None
        )
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output projection when the config says so (again after loading)."""
        if self.config.tie_word_embeddings and self.lm_head is not None:
            assert self.model.embed_tokens is not None  # the last stage holds it when tied
            self.lm_head.weight = self.model.embed_tokens.weight

    def prepare(self, widen_half_on_cpu: bool, triton_layers: bool = True) -> None:
        """Pick each layer's kernels for its device once the weights are final (see layers.py): linear
        weights widened where the CPU computes half precision in fp32, fused norms and activations on CPU,
        Triton norms and rotation on CUDA unless `triton_layers` is False (the torch reference's model: a
        reference that ran the same kernels could not catch them out).
        A tied lm_head keeps sharing the embedding unless it is widened (then it gets its own fp32 copy)."""
        like = self.model.first_layer().input_layernorm.weight
        self.model.rotary.prepare(like, triton_layers)
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare(widen_half_on_cpu)
            elif isinstance(module, RMSNorm):
                module.prepare(triton_layers)
            elif isinstance(module, SiluAndMul):
                module.prepare(like)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        plan: AttentionPlan | None = None,
        keep: torch.Tensor | None = None,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (or of the rows in `keep`, see
        LlamaModel.forward); logits are left to compute_logits, which the runner calls on the few rows it
        samples from (not every prefill token)."""
        return self.model(input_ids, positions, kv_caches, meta, plan, keep, lora)

    def lora_targets(self) -> dict[str, Target]:
        """The projections adapters may target (every layer's q/k/v, o, gate/up and down), by module name."""
        targets: dict[str, Target] = {}
        for name, module in self.named_modules():
            if not isinstance(module, Linear) or module is self.lm_head:
                continue
            layer = int(name.split(".")[2])  # model.layers.N.<self_attn|mlp>.<proj>
            proj = name.rsplit(".", 1)[1]
            parts, row = [], 0
            for part in module.parts or (Part(proj, module.out_features),):
                parts.append((part.name or proj, row, part.rows))
                row += part.rows
            targets[name] = Target(layer, module.in_features, tuple(parts))
        return targets

    def attach_lora(self, slots: LoRASlots) -> None:
        """Each target projection reads its stacked adapter weights from `slots`."""
        modules = dict(self.named_modules())
        for name in slots.targets:
            linear = modules[name]
            assert isinstance(linear, Linear)
            linear.lora_a, linear.lora_b = slots.a[name], slots.b[name]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The projection runs in the model's dtype (upcasting a large vocab's weight every step is a real
        # cost); the sampler gets fp32. Tensor parallel: every rank gets every rank's shard of the logits,
        # the last one's padding cut off. Pipeline parallel: the last stage's, sent to (and received by)
        # global rank 0.
        if self.lm_head is None:
            return self.pp.recv_logits(hidden.shape[0], self.config.vocab_size, hidden.device)
        logits = self.lm_head(hidden)
        if self.tp.world_size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
            if logits.shape[-1] != self.config.vocab_size:
                logits = logits[:, : self.config.vocab_size].contiguous()
        logits = logits.float()
        self.pp.send_logits(logits)
        return logits
