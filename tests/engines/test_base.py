"""The engine interface (trace_replay.engines.base): EngineConfig's validation, and what
EngineBase gives every engine (settings, stats, close, ``with``, the lazy tokenizer)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import torch

import trace_replay
from trace_replay.engines import ENGINES
from trace_replay.engines.base import (
    ENGINE_MEMBERS,
    PROVENANCE,
    Engine,
    EngineBase,
    EngineClosed,
    EngineConfig,
    ReplayRequest,
    check_engine,
)
from trace_replay.engines.capabilities import protocol_members

PACKAGE = Path(trace_replay.__file__).parent


def _capabilities() -> list[type]:
    """Every protocol declared by a shared module of engines/ but the core one: the
    capabilities (capabilities.py's, and those other modules add) a caller may check."""
    found = []
    for path in sorted((PACKAGE / "engines").glob("*.py")):
        module = importlib.import_module(
            f"trace_replay.engines.{path.stem}".replace(".__init__", "")
        )
        found += [
            value
            for value in vars(module).values()
            if isinstance(value, type)
            and getattr(value, "_is_protocol", False)
            and value.__module__ == module.__name__
            and value is not Engine
        ]
    return found


# what a caller may use: the core protocol's members and each capability's
DECLARED = {
    *ENGINE_MEMBERS,
    *(name for capability in _capabilities() for name in protocol_members(capability)),
}

# --- EngineConfig: checked before any model is loaded ---------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"top_k": -1}, "top_k must be an integer >= 0, got -1"),
        ({"top_k": "5"}, "top_k must be an integer"),
        ({"top_k": 2.0}, "top_k must be an integer >= 0, got 2.0"),
        ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
        ({"batch_size": True}, "batch_size must be an integer"),
        ({"deterministic": 1}, "deterministic must be True or False, got 1"),
        ({"dtype": "float7"}, "float7"),
        ({"device": "gpu"}, "device .gpu. is not a device name"),
        ({"device": 0}, "device must be a str or torch.device, got int"),
        # no machine has 99 GPUs: either none at all, or too few
        ({"device": "cuda:99"}, "device 'cuda:99' (is not available|does not exist)"),
    ],
)
def test_config_refuses_bad_values(fields, message):
    """EngineConfig validates on construction, naming the field and the value."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_config_defaults_leave_choices_to_the_engine():
    """Unset model, dtype, device and batch size are None (each engine picks); top_k is 5 and
    deterministic off."""
    assert EngineConfig() == EngineConfig(
        model=None, dtype=None, device=None, batch_size=None, top_k=5, deterministic=False
    )


def test_config_takes_good_values():
    """Valid values are kept as given: a dtype by name or torch.dtype, a CPU device,
    top_k 0 (no alternatives)."""
    config = EngineConfig(
        dtype=torch.bfloat16, device=torch.device("cpu"), batch_size=3, top_k=0, deterministic=True
    )
    assert (config.dtype, config.device, config.batch_size, config.top_k) == (
        torch.bfloat16,
        torch.device("cpu"),
        3,
        0,
    )
    assert EngineConfig(dtype="float16", device="cpu").dtype == "float16"


# --- EngineBase -----------------------------------------------------------------------------


class Counting(EngineBase):
    """EngineBase as a subclass fills it in (what its docstring asks), counting ``close``."""

    name = "counting"
    model_label, engine_path, dtype, device = "tiny", "count[test]", "float32", "cpu"
    batch_size, top_k = 2, 3
    closed = 0

    def run(self, requests, *, on_tokens=None):
        return []

    def close(self) -> None:
        self.closed += 1


def test_settings_are_the_common_provenance():
    """settings() names engine, path, model, dtype, device, slots, top_k and deterministic;
    selected_by only when make_engine("auto") set it."""
    engine = Counting()
    assert engine.settings() == {
        "engine": "counting",
        "engine_path": "count[test]",
        "model": "tiny",
        "dtype": "float32",
        "device": "cpu",
        "batch_size": 2,
        "top_k": 3,
        "deterministic": False,
    }
    engine.selected_by = "auto: torch (vllm is not installed)"
    assert engine.settings()["selected_by"] == "auto: torch (vllm is not installed)"
    assert engine.stats() == {}


def test_with_block_closes_the_engine_even_on_error():
    """``with engine`` gives the engine itself and closes it once on leaving, also when the
    block raises (the error propagates)."""
    engine = Counting()
    with engine as entered:
        assert entered is engine and engine.closed == 0
    assert engine.closed == 1
    with pytest.raises(KeyError):
        with engine:
            raise KeyError("boom")
    assert engine.closed == 2


def test_every_subclass_refuses_work_once_closed():
    """EngineBase marks any subclass's engine closed when its own close() has run: run,
    weights_digest, activations and generate (the class's own or the default) then raise
    EngineClosed naming the engine and the method, before any of their code runs; settings
    still answer. A subclass of a subclass, whose close() calls its parent's, is closed as
    well."""

    class Writer(Counting):
        def generate(self, prompts, *, max_tokens, temperature=0.0, seed=0, eos_token_id=None):
            return []

        def close(self) -> None:
            super().close()

    for engine in (Counting(), Writer()):
        assert engine.run([]) == [] and engine.weights_digest() is None
        engine.close()
        assert engine.closed == 1
        for call, method in (
            (lambda: engine.run([]), "run"),
            (engine.weights_digest, "weights_digest"),
            (engine.activations, "activations"),
            (lambda: engine.generate([[1]], max_tokens=1), "generate"),
        ):
            with pytest.raises(EngineClosed, match=rf"engine 'counting' is closed: {method}\(\)"):
                call()
        assert engine.settings()["engine"] == "counting"


def test_a_subclass_with_run_is_an_engine(tokenizer):
    """EngineBase supplies all of the Engine protocol but ``run``, which it declares abstract."""
    assert EngineBase.__abstractmethods__ == {"run"}
    with pytest.raises(TypeError, match="abstract method run"):
        EngineBase()
    counting = Counting()
    # Python 3.11's protocol check reads every member, the lazy tokenizer too: give it one
    counting.tokenizer = tokenizer
    assert isinstance(counting, Engine)
    check_engine(counting)


def test_check_engine_names_every_missing_member():
    """check_engine refuses an object lacking protocol members with a TypeError naming each
    of them (a duck-typed engine with run, settings and stats only is not enough)."""

    class Partial:
        name, batch_size = "partial", 1

        def run(self, requests, *, on_tokens=None):
            return []

        def settings(self):
            return {}

        def stats(self):
            return {}

    with pytest.raises(TypeError) as error:
        check_engine(Partial())
    lacks = str(error.value).split("it lacks ")[1].split(" (")[0].split(", ")
    assert set(lacks) == set(ENGINE_MEMBERS) - {"name", "batch_size", "run", "settings", "stats"}


def test_check_engine_evaluates_no_lazy_member():
    """check_engine counts a member its class defines without reading it: an engine whose
    tokenizer is loaded on first use (and cannot be, here) passes, and nothing is loaded."""

    class Lazy(EngineBase):
        name, model_label, engine_path, dtype, device, batch_size, top_k = (
            "lazy",
            "m",
            "lazy",
            "float32",
            "cpu",
            1,
            5,
        )
        loads = 0

        @property
        def tokenizer(self):
            Lazy.loads += 1
            raise FileNotFoundError("no tokenizer folder")

        def run(self, requests, *, on_tokens=None):
            return []

    check_engine(Lazy())
    assert Lazy.loads == 0


def test_check_engine_names_the_provenance_a_subclass_lacks():
    """A subclass of EngineBase with ``run`` alone is refused naming every provenance attribute
    it must set (PROVENANCE), not with an AttributeError from settings() in mid-replay."""

    class Bare(EngineBase):
        def run(self, requests, *, on_tokens=None):
            return []

    with pytest.raises(TypeError) as error:
        check_engine(Bare())
    lacks = str(error.value).split("it lacks ")[1].split(" (")[0].split(", ")
    assert set(PROVENANCE) <= set(lacks) and "engine_path" in lacks


def test_a_subclass_that_implements_generate_can_generate():
    """``can_generate`` follows the class: True where it overrides ``generate`` (so ``record``
    takes it), False where it keeps the base's refusal."""

    class Scorer(EngineBase):
        def run(self, requests, *, on_tokens=None):
            return []

    class Writer(Scorer):
        def generate(self, prompts, *, max_tokens, temperature=0.0, seed=0, eos_token_id=None):
            return [([1] * max_tokens, [0.0] * max_tokens) for _ in prompts]

    assert not Scorer().can_generate and Writer().can_generate


def test_base_defaults_say_what_an_engine_cannot_do():
    """Without a model in this process an engine cannot generate (``can_generate`` False),
    has no activations to give and no weights to digest; generate and activations raise
    NotImplementedError naming the engine."""
    engine = Counting()
    assert (engine.can_generate, engine.vocab_size, engine.weights_digest()) == (False, None, None)
    with pytest.raises(NotImplementedError, match="engine 'counting' cannot generate"):
        engine.generate([[1]], max_tokens=1)
    with pytest.raises(NotImplementedError, match="engine 'counting' runs its model outside"):
        engine.activations()


def test_weights_are_read_again_only_when_they_may_have_changed(monkeypatch):
    """The full pass over the weights runs once while they stay as they are (every replay
    asks); an in-place edit of one unsampled element (its edit count) or a rescale through
    ``.data`` (its sample) is read again and changes the digest."""
    engine = Counting()
    engine.lm = torch.nn.Linear(256, 512)  # 131,072 weights: every 128th is sampled
    passes = []
    read = EngineBase._read_weights
    monkeypatch.setattr(EngineBase, "_read_weights", lambda self: passes.append(1) or read(self))
    first = engine.weights_digest()
    assert engine.weights_digest() == first and len(passes) == 1
    with torch.no_grad():
        engine.lm.weight[0, 5] += 1.0  # element 5: between samples 0 and 128
    second = engine.weights_digest()
    assert second != first and len(passes) == 2
    engine.lm.weight.data.mul_(2.0)  # .data: no edit counted, the sample changes
    assert engine.weights_digest() not in (first, second) and len(passes) == 3


def test_tokenizer_loads_once_from_its_source(tokenizer):
    """The tokenizer is loaded from ``tokenizer_source`` (None: the embedded model) on first
    use and kept; assigning one replaces it."""
    engine = Counting()
    text = "def add(a, b): return a + b"
    assert engine.tokenizer.encode(text) == tokenizer.encode(text)
    assert engine.tokenizer is engine.tokenizer
    engine.tokenizer = tokenizer
    assert engine.tokenizer is tokenizer


def test_request_lengths_count_its_tokens():
    """A request's prompt_len and trace_len are the lengths of its two token tuples."""
    request = ReplayRequest("a", (1, 2, 3), (4,))
    assert (request.prompt_len, request.trace_len) == (3, 1)


# --- the protocol is declared, complete, and the only way in --------------------------------

ENGINE_CLASSES = {  # every engine make_engine builds: its module and class
    "torch": ("engines/builtin/engine.py", "TorchEngine"),
    "prefill": ("engines/builtin/prefill.py", "PrefillEngine"),
    "vllm": ("engines/vllm/engine.py", "VLLMEngine"),  # read, not imported (vllm is slow)
    "vllm-server": ("engines/server/engine.py", "ServerEngine"),
}


def _missing_members(source: str, class_name: str) -> set[str]:
    """The Engine members and EngineBase provenance attributes that class ``class_name`` of
    ``source`` (an EngineBase subclass) neither inherits with a value nor defines: methods,
    class attributes and ``self.<name> =`` assignments in any of its methods."""
    cls = next(
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef) and node.name == class_name
    )
    assert [ast.unparse(base) for base in cls.bases] == ["EngineBase"]
    defined = {node.name for node in cls.body if isinstance(node, ast.FunctionDef)}
    for node in ast.walk(cls):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign) and node.value
            else []
        )
        for target in targets:
            for name in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(name, ast.Name) and node in cls.body:  # a class attribute
                    defined.add(name.id)
                elif (
                    isinstance(name, ast.Attribute)
                    and isinstance(name.value, ast.Name)
                    and name.value.id == "self"
                ):
                    defined.add(name.attr)
    inherited = set(vars(EngineBase)) - EngineBase.__abstractmethods__
    required = {*ENGINE_MEMBERS, *(n for n in EngineBase.__annotations__ if n[0] != "_")}
    return required - inherited - defined


@pytest.mark.parametrize("name", sorted(ENGINE_CLASSES))
def test_every_engine_class_implements_the_whole_protocol(name):
    """Each engine class subclasses EngineBase, implements its abstract ``run`` and sets every
    attribute the protocol and EngineBase declare without a value (read from its source, so
    vLLM need not import); the classes that import cheaply are not abstract."""
    path, class_name = ENGINE_CLASSES[name]
    assert _missing_members((PACKAGE / path).read_text(), class_name) == set()
    if name != "vllm":
        module = importlib.import_module("trace_replay." + path[:-3].replace("/", "."))
        assert not inspect.isabstract(getattr(module, class_name))


def test_the_member_check_sees_what_a_class_lacks():
    """The source check above is not vacuous: every engine make_engine builds is listed, and
    a class that sets only some provenance and no ``run`` is missing exactly the rest."""
    assert set(ENGINE_CLASSES) == set(ENGINES) - {"auto"}
    half = (
        "class Half(EngineBase):\n    name = 'half'\n"
        "    def __init__(self):\n        self.batch_size, self.dtype = 1, 'float32'\n"
    )
    assert _missing_members(half, "Half") == {
        "run",
        "model_label",
        "engine_path",
        "device",
        "top_k",
    }


def _is_engine(node: ast.expr) -> bool:
    """Whether ``node`` names an engine as callers name them: ``engine``, ``engine_obj``,
    ``self.engine``, ``engines[i]``."""
    if isinstance(node, ast.Name):
        return node.id in ("engine", "engine_obj")
    if isinstance(node, ast.Attribute):
        return node.attr == "engine"
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "engines"
    )


def _engine_probes(source: str) -> tuple[set[str], int]:
    """``getattr``/``hasattr``/``setattr`` on an engine and reads of attributes the protocol
    does not declare, in ``source``; and the number of reads of declared members."""
    probes, uses = set(), 0
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.args
            and node.func.id in ("getattr", "hasattr", "setattr")
            and _is_engine(node.args[0])
        ):
            probes.add(ast.unparse(node))
        elif isinstance(node, ast.Attribute) and _is_engine(node.value):
            if node.attr in DECLARED:
                uses += 1
            else:
                probes.add(ast.unparse(node))
    return probes, uses


def test_no_module_outside_engines_probes_an_engine():
    """Outside ``trace_replay/engines/`` an engine is used only through the protocol: no
    getattr/hasattr on it, no attribute it does not declare (``engine.lm``,
    ``engine.backend``). The scan sees real uses (replay, record, checkpoints, attribution)
    and flags each probing pattern callers used before the protocol was declared."""
    probes, uses = {}, 0
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] != "engines":
            found, used = _engine_probes(path.read_text())
            probes.update({f"{relative}: {probe}": None for probe in found})
            uses += used
    assert list(probes) == []
    assert uses >= 20
    before = (
        "lms = [engine.lm for engine in engines]\n"
        "size = getattr(engine, 'vocab_size', None)\n"
        "digest = getattr(engine, 'weights_digest', lambda: None)()\n"
        "ok = all(callable(getattr(engine, m, None)) for m in ('run', 'stats'))\n"
        "model = engines[0].backend.model\n"
        "watched = hasattr(self.engine, 'on_batch')\n"
    )
    assert _engine_probes(before)[0] == {
        "engine.lm",
        "getattr(engine, 'vocab_size', None)",
        "getattr(engine, 'weights_digest', lambda: None)",
        "getattr(engine, m, None)",
        "engines[0].backend",
        "hasattr(self.engine, 'on_batch')",
    }
