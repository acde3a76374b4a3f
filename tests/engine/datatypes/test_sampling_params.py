import ast
import dataclasses
import inspect
import subprocess
import sys

import pytest

from chunkwise.engine.datatypes import sampling_params as sp_module
from chunkwise.engine.datatypes.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (1, 16, 1.0, 1.0, 0, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == ((), (), False, None)
    assert (p.presence_penalty, p.frequency_penalty) == (0.0, 0.0)
    assert (p.include_stop_str_in_output, p.skip_special_tokens) == (False, True)
    assert not p.greedy
    assert not p.has_penalty


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", sp_module.MAX_N + 1),
        ("n", 0),
        ("n", 2.0),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_k", 2**31),
        ("seed", 1.5),
        ("seed", 1 << 64),
        ("seed", -(1 << 63) - 1),
        ("stop", [""]),
        ("stop", ""),
        ("stop", ["ok", 3]),
        ("stop", 7),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1, 2.0]),
        ("stop_token_ids", "12"),
        ("stop_token_ids", 5),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", float("nan")),
        ("logprobs", -1),
        ("logprobs", 21),
        ("ignore_eos", "yes"),
        ("include_stop_str_in_output", 1),
        ("skip_special_tokens", None),
    ],
)
def test_bad_field_names_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    message = str(excinfo.value)
    assert field in message
    assert repr(value) in message


def test_n_error_names_the_range() -> None:
    with pytest.raises(ValueError, match=rf"n must be in \[1, {sp_module.MAX_N}\], got 65"):
        SamplingParams(n=65)
    with pytest.raises(ValueError, match="n must be an integer"):
        SamplingParams(n=True)  # type: ignore[arg-type]


def test_child_seed_is_seed_plus_index_wrapped_into_range() -> None:
    assert [sp_module.child_seed(7, i) for i in range(3)] == [7, 8, 9]
    top = (1 << 64) - 1
    assert sp_module.child_seed(top, 0) == top
    assert sp_module.child_seed(top, 1) == -(1 << 63)  # wraps to the bottom of torch's accepted range


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 1),
        ("n", 3),
        ("n", sp_module.MAX_N),
        ("max_tokens", 1),
        ("max_tokens", None),
        ("temperature", 0.0),
        ("temperature", 0),
        ("temperature", 1e-30),
        ("top_p", 1e-6),
        ("top_k", 1),
        ("top_k", 0),
        ("seed", 0),
        ("seed", (1 << 64) - 1),
        ("seed", -(1 << 63)),
        ("presence_penalty", -2.0),
        ("frequency_penalty", 2),
        ("logprobs", 0),
        ("logprobs", 20),
    ],
)
def test_boundary_values_are_accepted(field: str, value: object) -> None:
    p = SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert getattr(p, field) == value


def test_normalisation() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=[3, 0]).stop_token_ids == (3, 0)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    p = SamplingParams(temperature=1, presence_penalty=1)
    assert isinstance(p.temperature, float)
    assert isinstance(p.presence_penalty, float)


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert not SamplingParams(temperature=0.7, top_k=2).greedy
    assert not SamplingParams(temperature=1e-6).greedy


def test_frozen_and_replace_revalidates() -> None:
    p = SamplingParams(stop="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]
    q = dataclasses.replace(p, temperature=0.5)
    assert q.temperature == 0.5
    assert q.stop == ("x",)
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p, top_p=2.0)


def test_equal_params_are_equal_and_hashable() -> None:
    a = SamplingParams(stop=["x"], stop_token_ids=[1])
    b = SamplingParams(stop=("x",), stop_token_ids=(1,))
    assert a == b
    assert hash(a) == hash(b)


def test_typed_init_matches_the_fields() -> None:
    # The TYPE_CHECKING-only __init__ exists for mypy; nothing at runtime would notice it drifting.
    tree = ast.parse(inspect.getsource(sp_module))
    inits = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "__init__"]
    assert len(inits) == 1
    args = inits[0].args
    names = [a.arg for a in args.args[1:]]
    defaults = [ast.literal_eval(d) for d in args.defaults]
    fields = dataclasses.fields(SamplingParams)
    assert names == [f.name for f in fields]
    runtime_defaults = SamplingParams()
    for name, default in zip(names, defaults):
        # stop and stop_token_ids declare None, which normalises to the field's ().
        assert SamplingParams(**{name: default}) == runtime_defaults, name


def test_does_not_import_torch() -> None:
    code = "import sys, chunkwise.engine.datatypes.sampling_params; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
