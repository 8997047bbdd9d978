"""Configuration (configuration.md): environment variables, an optional TOML file, validated at start-up."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from bridge.errors import ConfigError

ENV_PREFIX = "NPC_BRIDGE_"
CONFIG_FILE_VARIABLE = "NPC_BRIDGE_CONFIG"

DEFAULT_MOOD_WORDS = (
    "疲れ",
    "眠い",
    "眠た",
    "お腹",
    "空腹",
    "満腹",
    "体調",
    "機嫌",
    "気分",
    "頭痛",
    "だるい",
    "今日は",
)
DEFAULT_NON_FACT_WORDS = (
    "言及はない",
    "言及がない",
    "言及していない",
    "決めていない",
    "決まっていない",
    "特にない",
    "特になし",
    "分からない",
    "わからない",
    "不明",
    "明らかでない",
    "情報はない",
)
DEFAULT_ORDER_WORDS = ("注文", "頼んでいる", "頼んだ", "頼もう", "オーダー")

WordList = Annotated[tuple[str, ...], NoDecode]


def _split_words(value: Any) -> Any:
    # Lists come from the environment as comma-separated text; from TOML as real arrays.
    if isinstance(value, str):
        return tuple(word.strip() for word in value.split(",") if word.strip())
    return value


class _TomlSource(PydanticBaseSettingsSource):
    """Keys of the TOML file named by NPC_BRIDGE_CONFIG: the variable names, lower case, no prefix."""

    def __init__(self, settings_cls: type[BaseSettings], data: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self._data = data

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return {k: v for k, v in self._data.items() if k in self.settings_cls.model_fields}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    world_url: str = "http://127.0.0.1:2567"
    world_room: str = Field("world", min_length=1)
    world_token: SecretStr | None = None
    world_token_file: Path | None = None

    llm_backend: Literal["ollama", "coordinator", "openai"] = "ollama"
    llm_url: str = "http://127.0.0.1:11434"
    llm_model: str = Field("elyza-jp-8b", min_length=1)
    llm_worker: str = Field("macbookair", min_length=1)
    llm_concurrency: int = Field(1, ge=1, le=16)
    # Not in the spec table: the model's context window, used to fit memories and history (tokens).
    llm_context_tokens: int = Field(4096, ge=512)

    reply_deadline_seconds: float = Field(90.0, gt=0)
    reply_max_sentences: int = Field(2, ge=1, le=10)
    reply_max_chars: int = Field(90, ge=10, le=1000)
    say_parts: Literal["auto", "off"] = "auto"
    banned_words: WordList = ()

    characters_dir: Path = Path("./characters")
    memory_dir: Path = Path("./memory")
    memory_silence_seconds: float = Field(120.0, gt=0)
    memory_recall: int = Field(10, ge=0, le=100)
    memory_recall_recent: int = Field(3, ge=0, le=100)
    memory_embed_model: str | None = None
    memory_limit: int = Field(60, ge=1, le=10000)
    memory_subject: str = Field("ユーザー", min_length=1)
    memory_mood_words: WordList = DEFAULT_MOOD_WORDS
    memory_non_fact_words: WordList = DEFAULT_NON_FACT_WORDS
    memory_order_words: WordList = DEFAULT_ORDER_WORDS
    history_minutes: float = Field(30.0, ge=0)
    shared_memory_url: str | None = None

    timezone: str | None = None
    log_format: Literal["json", "console"] = "json"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_content: bool = False

    @field_validator("world_url", "llm_url", "shared_memory_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http:// or https:// URL, got {value!r}")
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise ValueError(f"has an invalid port: {value!r}") from None
        return value.rstrip("/")

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str | None) -> str | None:
        if value:
            try:
                ZoneInfo(value)
            except (ZoneInfoNotFoundError, ValueError):
                raise ValueError(f"unknown time zone {value!r}") from None
        return value or None

    @field_validator("log_format", "log_level", "llm_backend", "say_parts", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("banned_words", "memory_mood_words", "memory_non_fact_words", "memory_order_words", mode="before")
    @classmethod
    def _words(cls, value: Any) -> Any:
        return _split_words(value)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Precedence: explicit arguments > environment > TOML file.
        return (init_settings, env_settings, _TomlSource(settings_cls, _read_toml()))

    def zone(self) -> ZoneInfo | None:
        """The configured zone, or None for the system's local time."""
        return ZoneInfo(self.timezone) if self.timezone else None

    def token(self) -> str | None:
        """The worker token from the variable or from the file it names; None when neither is set."""
        if self.world_token is not None and self.world_token.get_secret_value():
            return self.world_token.get_secret_value()
        if self.world_token_file is not None:
            try:
                text = self.world_token_file.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(
                    f"NPC_BRIDGE_WORLD_TOKEN_FILE: cannot read {self.world_token_file}: {exc.strerror}"
                ) from None
            if not text:
                raise ConfigError(f"NPC_BRIDGE_WORLD_TOKEN_FILE: {self.world_token_file} is empty")
            return text
        return None

    def require_token(self) -> str:
        token = self.token()
        if token is None:
            raise ConfigError("NPC_BRIDGE_WORLD_TOKEN: required to run (set it, or NPC_BRIDGE_WORLD_TOKEN_FILE)")
        return token


def _read_toml() -> dict[str, Any]:
    name = os.environ.get(CONFIG_FILE_VARIABLE)
    if not name:
        return {}
    path = Path(name)
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"{CONFIG_FILE_VARIABLE}: cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{CONFIG_FILE_VARIABLE}: {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(Settings.model_fields))
    if unknown:
        raise ConfigError(f"{CONFIG_FILE_VARIABLE}: {path}: unknown key {unknown[0]!r}")
    return data


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    field = str(first["loc"][0]) if first["loc"] else ""
    variable = ENV_PREFIX + field.upper() if field else "configuration"
    message = first["msg"].removeprefix("Value error, ")
    given = first.get("input")
    if field == "world_token" or given is None or isinstance(given, dict) or repr(given) in message:
        return f"{variable}: {message}"
    return f"{variable}: {message} (got {str(given)[:60]!r})"


def load_settings(**overrides: Any) -> Settings:
    """Read and validate the configuration; raise ConfigError with one line naming the variable."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
