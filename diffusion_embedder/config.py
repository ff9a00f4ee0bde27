"""``EncoderConfig``: the one definition of every setting that changes an embedding.

The training config's model fields and the evaluation CLI's flags are derived from these fields
(names, types, defaults, choices, help), so a setting has one name and one default everywhere.
``resolve_config`` is the one place settings are assembled; its layers are ``LAYERS``, lowest first.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from diffusion_embedder.files import read_json_object
from diffusion_embedder.pooling import POOLING_MODES
from diffusion_embedder.similarity import SIMILARITY_FUNCTIONS
from diffusion_embedder.values import AT_LEAST_ONE, OptionError, choice_problem, problem, range_problem

ENCODER_CONFIG = "encoder_config.json"
LLM2VEC_CONFIG = "llm2vec_config.json"
#: The latent-attention head's weights in an encoder folder (``latent_attention`` pooling only).
POOLING_WEIGHTS = "pooling.safetensors"
#: What LLM2Vec's own ``llm2vec_config.json`` holds (all it reads from a checkpoint).
LLM2VEC_KEYS = ("pooling_mode", "max_length", "doc_max_length", "skip_instruction")
#: Where settings come from, lowest priority first; ``resolve_config`` applies them in this order.
LAYERS = ("defaults", LLM2VEC_CONFIG, ENCODER_CONFIG, "known checkpoint names", "explicit arguments")


def _setting(default, help: str, choices: tuple | None = None, **extra):
    """A user-facing setting: exposed as a training-config field and an evaluation flag."""
    metadata = {"help": help, "choices": choices, "setting": True, **extra}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _provenance(help: str, **kwargs):
    """Filled in by the loader (where the weights came from), not chosen by the user."""
    return field(metadata={"help": help, "setting": False}, **kwargs)


@dataclass
class EncoderConfig:
    """Every setting that changes an embedding; saved as ``encoder_config.json``; immutable once built.

    Its fields cannot be reassigned (``replace`` makes a validated copy); other attributes can, because
    Hugging Face's Trainer writes ``model.config.use_cache`` on whatever model it is given.
    """

    base_model_name_or_path: str = _provenance("Checkpoint the base weights were loaded from.", default="")
    model_type: str = _provenance("Backbone family (backbones.py table).", default="")
    pooling_mode: str = _setting("mean", "How token states become one vector.", POOLING_MODES)
    max_length: int = _setting(512, "Tokens per text (instruction, template and text); longer texts are cut.")
    doc_max_length: int = _setting(400, "Tokens of the text itself kept at encode time (documents).")
    skip_instruction: bool = _setting(True, "Pool over the text only, not the instruction's tokens.")
    enable_bidirectional: bool = _setting(True, "Remove the causal mask (false: the paper's causal ablation).")
    prompt_template: str | None = _setting(
        None, "Chat wrapper with one {text} slot, used at training and evaluation alike; null: none or the "
        "known checkpoint's."
    )
    eos_suffix: str | None = _setting(
        None, "String appended for eos_token pooling; null: derived from the backbone (LLM2Vec's)."
    )
    mask_readout_tokens: int = _setting(
        1, "mask_token pooling: how many mask tokens are appended after the text and averaged."
    )
    latent_num_latents: int = _setting(512, "latent_attention pooling: number of latents.")
    latent_num_heads: int = _setting(8, "latent_attention pooling: attention heads.")
    prompts: dict[str, str] = _setting(
        {}, 'Named instructions (JSON object): encode(texts, prompt_name="query") is '
        'encode([[prompts["query"], t] ...]).'
    )
    similarity_fn_name: str = _setting(
        "cosine", "What similarity() computes (sentence-transformers' names).", tuple(SIMILARITY_FUNCTIONS)
    )
    merged_adapters: tuple[str, ...] = _provenance(
        "Adapters merged into the base before this checkpoint's own (e.g. LLM2Vec's MNTP).", default=()
    )

    def __post_init__(self):
        self.merged_adapters = tuple(self.merged_adapters)
        check_values(dataclasses.asdict(self), "EncoderConfig")
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name: str, value) -> None:
        if name in _fields() and self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"EncoderConfig is immutable: use config.replace({name}=...) (or the encoder's attribute)."
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name in _fields():
            raise dataclasses.FrozenInstanceError(f"EncoderConfig is immutable: cannot delete {name}.")
        object.__delattr__(self, name)

    @property
    def applied_eos_suffix(self) -> str:
        """The EOS string appended to every text: ``eos_suffix`` under ``eos_token`` pooling only, as LLM2Vec
        (``last_token`` pools the text's own end)."""
        return (self.eos_suffix or "") if self.pooling_mode == "eos_token" else ""

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        values["merged_adapters"] = list(self.merged_adapters)
        return values

    @classmethod
    def from_dict(cls, values: dict, source: str = "encoder settings") -> EncoderConfig:
        return cls(**check_values(values, source))

    def replace(self, **changes) -> EncoderConfig:
        """A copy with ``changes`` (validated like any other source)."""
        return dataclasses.replace(self, **check_values(changes, "encoder settings"))


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(EncoderConfig)}


def setting_fields() -> list[dataclasses.Field]:
    """The user-facing settings, in declaration order (what configs and CLIs expose)."""
    return [f for f in dataclasses.fields(EncoderConfig) if f.metadata.get("setting")]


#: The names of the user-facing settings, in declaration order: the one list every caller uses.
SETTING_NAMES: tuple[str, ...] = tuple(f.name for f in setting_fields())


def field_types() -> dict[str, typing.Any]:
    return typing.get_type_hints(EncoderConfig)


def check_values(values: dict, source: str) -> dict:
    """Every problem of ``values`` (unknown key, wrong type, bad value) in one ``OptionError`` naming ``source``."""
    if not isinstance(values, dict):
        raise OptionError(f"{source}: expected a JSON object of settings, got {type(values).__name__}.")
    known, hints = _fields(), field_types()
    errors = []
    for key, value in values.items():
        if key not in known:
            errors.append(f"unknown setting {key!r} (known: {', '.join(known)})")
        else:
            found = problem(key, value, hints[key]) or value_problem(key, value)
            if found:
                errors.append(found)
    if errors:
        raise OptionError(f"Invalid {source}:\n  - " + "\n  - ".join(errors))
    return values


#: The settings that count something: each at least 1.
COUNTS = ("max_length", "doc_max_length", "mask_readout_tokens", "latent_num_latents", "latent_num_heads")


def value_problem(key: str, value: typing.Any) -> str | None:
    """Why ``value`` (of the setting's type) cannot be used for setting ``key`` (None when it can)."""
    found = choice_problem(key, value, _fields()[key].metadata.get("choices")) or range_problem(
        key, value, AT_LEAST_ONE if key in COUNTS else None
    )
    if found:
        return found
    if key == "prompt_template" and value is not None and value.count("{text}") != 1:
        return (
            f"prompt_template: {value!r} must contain {{text}} exactly once (it holds the input text); "
            f"it contains it {value.count('{text}')} times"
        )
    return None


def read_settings(path: str | None, keys: typing.Iterable[str] | None = None) -> dict:
    """Settings from a JSON file (``keys``: only those), types checked; errors name the file and key."""
    if path is None:
        return {}
    values = read_json_object(path)
    if keys is not None:
        values = {k: v for k, v in values.items() if k in keys}
    return check_values(values, path)


def resolve_config(
    llm2vec: dict | None = None,
    encoder: dict | None = None,
    known: dict | None = None,
    explicit: dict | None = None,
) -> EncoderConfig:
    """The settings of one encoder, each from the highest layer that gives it (``LAYERS``, lowest first).

    Pure: no file or weight is read. In ``explicit`` a None means "not given".
    """
    layers = [llm2vec or {}, encoder or {}, known or {}, {k: v for k, v in (explicit or {}).items() if v is not None}]
    values: dict = {}
    for layer in layers:
        values.update(layer)
    return EncoderConfig(**check_values(values, "encoder settings"))
