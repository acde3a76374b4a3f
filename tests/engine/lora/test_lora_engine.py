"""LoRA adapters in the engine: a step mixing two adapters and the base model gives each prompt the greedy
tokens of the PEFT-merged model (transformers, float32); no step runs more adapters than max_loras; the same
prompt under two adapters shares no KV; unsupported adapters are refused naming the field."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from chunkwise import LLM, LoRARequest, SamplingParams
from tests.hf_models import peft_merged_greedy, save_random_family, save_random_lora

# The same checks on a GPU: CHUNKWISE_TEST_DEVICE=cuda (run by hand on the device machine; docs/benchmarks.md).
DEVICE = os.environ.get("CHUNKWISE_TEST_DEVICE", "cpu")
# A small cache, sized explicitly: on a GPU the default takes 90% of it, and this module builds many engines.
ON_DEVICE = {"device": DEVICE, "kv_cache_memory_bytes": 1 << 26}
PROMPTS = [
    [5, 17, 93, 41, 8, 77, 120, 3],
    [9, 9, 200, 31],
    [44, 12, 150, 7, 66, 81, 19, 230, 2, 14, 90],
    [71, 3],
]
MAX_NEW = [10, 12, 9, 11]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("lora")
    base = save_random_family(tmp, "qwen3", seed=3)
    # Different ranks and targets: q and v only (an adapter on q but not on k, inside the fused q/k/v), and
    # every projection with rsLoRA scaling.
    qv = save_random_lora(base, tmp / "qv", r=4, targets=["q_proj", "v_proj"], alpha=8.0, seed=1)
    every = save_random_lora(
        base,
        tmp / "every",
        r=8,
        targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        alpha=4.0,
        use_rslora=True,
        seed=2,
    )
    return {"base": base, "qv": qv, "every": every, "tmp": tmp}


def _generate(llm: LLM, loras: list[LoRARequest | None]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_NEW]
    outs = llm.generate(PROMPTS, params, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def _mixed(models: dict[str, Path]) -> tuple[list[LoRARequest | None], list[list[int]]]:
    """The prompts' adapters (two, the base model, the first again) and PEFT's merged models' greedy tokens."""
    qv = LoRARequest("qv", 1, str(models["qv"]))
    every = LoRARequest("every", 2, str(models["every"]))
    loras: list[LoRARequest | None] = [qv, every, None, qv]
    expected = [
        peft_merged_greedy(models["base"], models[lo.lora_name] if lo else None, [p], [n], models["tmp"])[0]
        for p, n, lo in zip(PROMPTS, MAX_NEW, loras)
    ]
    return loras, expected


def test_a_step_mixing_two_adapters_and_the_base_model_matches_peft_merged(models: dict[str, Path]) -> None:
    loras, expected = _mixed(models)
    # The adapters change the tokens (else the check below would not tell them apart).
    base_only = peft_merged_greedy(models["base"], None, PROMPTS, MAX_NEW, models["tmp"])
    assert expected[0] != base_only[0] and expected[1] != base_only[1]
    llm = LLM(
        str(models["base"]), dtype="float32", enable_lora=True, **ON_DEVICE, max_loras=2, max_lora_rank=8
    )
    steps: list[set[str]] = []
    activate = llm.engine.runner.lora.activate

    def recording(names):  # type: ignore[no-untyped-def]
        names = list(names)
        steps.append(set(names))
        return activate(names)

    llm.engine.runner.lora.activate = recording  # type: ignore[method-assign]
    assert _generate(llm, loras) == expected
    assert {"qv", "every"} in steps  # both adapters did share a step with the base model's row


def test_one_slot_runs_one_adapter_per_step_and_swaps_them_in_turn(models: dict[str, Path]) -> None:
    loras, expected = _mixed(models)
    llm = LLM(
        str(models["base"]), dtype="float32", enable_lora=True, **ON_DEVICE, max_loras=1, max_lora_rank=8
    )
    slots = llm.engine.runner.lora
    widest = 0
    activate = slots.activate

    def recording(names):  # type: ignore[no-untyped-def]
        nonlocal widest
        names = list(names)
        widest = max(widest, len(set(names)))
        return activate(names)

    slots.activate = recording  # type: ignore[method-assign]
    assert _generate(llm, loras) == expected
    assert widest == 1  # the scheduler held "every" back while "qv" ran, the base row beside either
    assert slots.loads >= 2


def test_the_same_prompt_under_two_adapters_shares_no_kv(models: dict[str, Path]) -> None:
    qv = LoRARequest("qv", 1, str(models["qv"]))
    llm = LLM(str(models["base"]), dtype="float32", enable_lora=True, **ON_DEVICE, block_size=4)
    prompt = list(range(3, 40))
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def cached(lora: LoRARequest | None) -> int:
        req = llm.engine.add_request(f"r{cached.n}", prompt, sp, lora_request=lora)  # type: ignore[attr-defined]
        cached.n += 1  # type: ignore[attr-defined]
        while llm.engine.has_unfinished():
            llm.engine.step()
        return req.num_cached_tokens

    cached.n = 0  # type: ignore[attr-defined]
    assert cached(qv) == 0
    assert cached(None) == 0  # the base model's KV of the same prompt is not the adapter's
    assert cached(qv) > 0 and cached(None) > 0  # each is reused under its own key


def _adapter(models: dict[str, Path], name: str, **changes: object) -> Path:
    """A copy of the q/v adapter with its adapter_config.json changed."""
    out = models["tmp"] / name
    out.mkdir(exist_ok=True)
    cfg = json.loads((models["qv"] / "adapter_config.json").read_text())
    cfg.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    (out / "adapter_model.safetensors").write_bytes((models["qv"] / "adapter_model.safetensors").read_bytes())
    return out


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_dora": True}, "use_dora: DoRA"),
        ({"r": 32}, "r 32 is above max_lora_rank 16"),
        ({"bias": "all"}, "bias 'all' is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
    ],
)
def test_unsupported_adapters_are_refused_naming_the_field(
    models: dict[str, Path], changes: dict[str, object], message: str
) -> None:
    llm = LLM(str(models["base"]), dtype="float32", enable_lora=True, **ON_DEVICE)
    bad = _adapter(models, f"bad-{next(iter(changes))}", **changes)
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), lora_request=LoRARequest("bad", 9, str(bad)))
    assert not llm.engine.has_unfinished()


def test_other_bad_requests_are_refused(models: dict[str, Path], tmp_path: Path) -> None:
    qv = LoRARequest("qv", 1, str(models["qv"]))
    plain = LLM(str(models["base"]), dtype="float32")
    with pytest.raises(ValueError, match=r"the engine serves none .*--enable-lora"):
        plain.generate([PROMPTS[0]], lora_request=qv)
    llm = LLM(str(models["base"]), dtype="float32", enable_lora=True, **ON_DEVICE)
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        llm.generate([PROMPTS[0]], lora_request=LoRARequest("x", 2, str(tmp_path)))
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1), lora_request=qv)
    with pytest.raises(ValueError, match=r"already loaded from .* give the new one another name"):
        llm.generate([PROMPTS[0]], lora_request=LoRARequest("qv", 1, str(models["every"])))
    # An adapter of a wider model: its shapes do not fit.
    from safetensors.torch import load_file, save_file

    foreign = _adapter(models, "foreign")
    tensors = load_file(str(foreign / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0], 2 * tensors[key].shape[1])
    save_file(tensors, str(foreign / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="an adapter for another model"):
        llm.generate([PROMPTS[0]], lora_request=LoRARequest("foreign", 3, str(foreign)))
    with pytest.raises(ValueError, match="lora_kernel 'triton' needs a CUDA device, not 'cpu'"):
        LLM(str(models["base"]), enable_lora=True, lora_kernel="triton")
    with pytest.raises(ValueError, match="enable_lora with tensor or pipeline parallel is not supported"):
        LLM(str(models["base"]), enable_lora=True, tensor_parallel_size=2)


def test_host_memory_keeps_max_cpu_loras_and_reads_the_others_again(models: dict[str, Path]) -> None:
    from chunkwise.engine.lora.store import AdapterStore
    from chunkwise.engine.model.loader import read_checkpoint

    store = AdapterStore(read_checkpoint(models["base"])[0], max_lora_rank=8, max_cpu_loras=1)
    qv = store.get(store.register(LoRARequest("qv", 1, str(models["qv"]))))
    store.register(LoRARequest("every", 2, str(models["every"])))
    assert store.in_host_memory() == ["every"]  # qv pushed out
    again = store.get("qv")  # read again from its directory: the same weights
    assert again is not qv and again.weights.keys() == qv.weights.keys()
    assert all(torch.equal(again.weights[k][1], qv.weights[k][1]) for k in qv.weights)
    # Removed (unloaded): no longer served, but a request still in flight finds its weights.
    assert store.remove("qv") and "qv" not in store.known()
    assert store.get("qv").rank == 4
    with pytest.raises(KeyError, match="never loaded"):
        store.get("nope")


def test_a_name_loaded_again_from_another_path_runs_the_new_weights_and_none_of_the_old_kv(
    models: dict[str, Path],
) -> None:
    llm = LLM(str(models["base"]), dtype="float32", enable_lora=True, block_size=4, **ON_DEVICE)
    prompt = list(range(3, 40))
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    old = llm.generate([prompt], sp, lora_request=LoRARequest("x", 1, str(models["qv"])))[0]
    assert llm.engine.adapters is not None and llm.engine.adapters.remove("x")
    new = llm.generate([prompt], sp, lora_request=LoRARequest("x", 2, str(models["every"])))[0]
    assert new.num_cached_tokens == 0  # the old weights' blocks of this prompt are not the new ones'
    expected = peft_merged_greedy(models["base"], models["every"], [prompt], [6], models["tmp"])[0]
    assert new.outputs[0].token_ids == expected != old.outputs[0].token_ids


def test_decode_steps_with_adapter_rows_do_not_replay_the_graphs(models: dict[str, Path]) -> None:
    # The padded path CUDA graphs replay (here eagerly, capture=False) has no adapters: such a step must not
    # take it, or its adapter rows would run the base model.
    from chunkwise.engine.worker.cuda_graphs import bucket_sizes

    loras, expected = _mixed(models)
    llm = LLM(
        str(models["base"]), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, **ON_DEVICE
    )
    llm.engine.runner.use_decode_graphs(bucket_sizes(8), capture=False)
    assert _generate(llm, loras) == expected
