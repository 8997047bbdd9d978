"""Configuration: names, defaults, precedence (explicit > environment > TOML), one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.errors import ConfigError
from bridge.settings import load_settings, typo_warnings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("NPC_BRIDGE_") or name == "CREDENTIALS_DIRECTORY":
            monkeypatch.delenv(name)


def test_defaults_match_the_configuration_table() -> None:
    s = load_settings()
    assert s.world_url == "http://127.0.0.1:2567"
    assert s.world_room == "world"
    assert s.llm_backend == "ollama"
    assert s.llm_url == "http://127.0.0.1:11434"
    assert s.llm_model == "elyza-jp-8b"
    assert s.llm_worker == "macbookair"
    assert s.llm_concurrency == 1
    assert s.reply_deadline_seconds == 90
    assert s.reply_max_sentences == 2
    assert s.reply_max_chars == 90
    assert s.characters_dir == Path("./characters")
    assert s.memory_dir == Path("./memory")
    assert s.memory_silence_seconds == 120
    assert s.memory_recall == 10
    assert s.memory_limit == 60
    assert s.history_minutes == 30
    assert s.shared_memory_url is None
    assert s.timezone is None
    assert s.log_format == "json"
    assert s.log_level == "info"
    assert s.log_content is False
    assert s.token() is None


def test_environment_wins_over_the_toml_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "bridge.toml"
    config.write_text('llm_model = "from-toml"\nworld_room = "toml-room"\nmemory_recall = 3\n', encoding="utf-8")
    monkeypatch.setenv("NPC_BRIDGE_CONFIG", str(config))
    monkeypatch.setenv("NPC_BRIDGE_LLM_MODEL", "from-env")
    s = load_settings()
    assert s.llm_model == "from-env"
    assert s.world_room == "toml-room"
    assert s.memory_recall == 3


def test_token_is_read_from_the_token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("file-token\n", encoding="utf-8")
    monkeypatch.setenv("NPC_BRIDGE_WORLD_TOKEN_FILE", str(token_file))
    assert load_settings().require_token() == "file-token"


def test_token_variable_wins_over_the_token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("file-token", encoding="utf-8")
    monkeypatch.setenv("NPC_BRIDGE_WORLD_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("NPC_BRIDGE_WORLD_TOKEN", "env-token")
    assert load_settings().require_token() == "env-token"


def test_missing_token_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"^NPC_BRIDGE_WORLD_TOKEN: required"):
        load_settings().require_token()


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot read"), ("", "is empty")],
)
def test_unreadable_or_empty_token_file_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str | None, message: str
) -> None:
    token_file = tmp_path / "token"
    if content is not None:
        token_file.write_text(content, encoding="utf-8")
    monkeypatch.setenv("NPC_BRIDGE_WORLD_TOKEN_FILE", str(token_file))
    with pytest.raises(ConfigError, match=rf"^NPC_BRIDGE_WORLD_TOKEN_FILE: .*{message}"):
        load_settings().require_token()


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("NPC_BRIDGE_WORLD_URL", "ftp://world"),
        ("NPC_BRIDGE_WORLD_URL", "not a url"),
        ("NPC_BRIDGE_WORLD_URL", "http://host:99999"),
        ("NPC_BRIDGE_WORLD_ROOM", ""),
        ("NPC_BRIDGE_LLM_BACKEND", "gpt"),
        ("NPC_BRIDGE_LLM_URL", "localhost:11434"),
        ("NPC_BRIDGE_LLM_MODEL", ""),
        ("NPC_BRIDGE_LLM_CONCURRENCY", "0"),
        ("NPC_BRIDGE_LLM_CONCURRENCY", "many"),
        ("NPC_BRIDGE_REPLY_DEADLINE_SECONDS", "-1"),
        ("NPC_BRIDGE_REPLY_MAX_SENTENCES", "0"),
        ("NPC_BRIDGE_REPLY_MAX_CHARS", "5"),
        ("NPC_BRIDGE_MEMORY_SILENCE_SECONDS", "0"),
        ("NPC_BRIDGE_MEMORY_RECALL", "-2"),
        ("NPC_BRIDGE_MEMORY_LIMIT", "0"),
        ("NPC_BRIDGE_HISTORY_MINUTES", "soon"),
        ("NPC_BRIDGE_SHARED_MEMORY_URL", "memory-service"),
        ("NPC_BRIDGE_TIMEZONE", "Mars/Olympus_Mons"),
        ("NPC_BRIDGE_LOG_FORMAT", "xml"),
        ("NPC_BRIDGE_LOG_LEVEL", "loud"),
        ("NPC_BRIDGE_LOG_CONTENT", "perhaps"),
    ],
)
def test_each_bad_value_is_one_line_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as caught:
        load_settings()
    message = str(caught.value)
    assert message.startswith(f"{variable}: ")
    assert "\n" not in message


def test_bad_toml_file_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "bridge.toml"
    config.write_text("llm_model = \n", encoding="utf-8")
    monkeypatch.setenv("NPC_BRIDGE_CONFIG", str(config))
    with pytest.raises(ConfigError, match=r"^NPC_BRIDGE_CONFIG: .*not valid TOML"):
        load_settings()


def test_unknown_toml_key_is_a_warning_naming_the_closest_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "bridge.toml"
    config.write_text('llm_modle = "typo"\nworld_room = "town"\n', encoding="utf-8")
    monkeypatch.setenv("NPC_BRIDGE_CONFIG", str(config))
    assert load_settings().world_room == "town"  # starts: the typo keeps its setting's default
    assert typo_warnings() == [
        f"NPC_BRIDGE_CONFIG: key 'llm_modle' in {config} is not a setting; did you mean llm_model?"
    ]


def test_unknown_variable_is_a_warning_naming_the_closest_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPC_BRIDGE_LLM_BACKND", "openai")
    monkeypatch.setenv("NPC_BRIDGE_NOTHING_LIKE_ANYTHING", "1")
    assert load_settings().llm_backend == "ollama"
    assert typo_warnings() == [
        "NPC_BRIDGE_LLM_BACKND is not a setting; did you mean NPC_BRIDGE_LLM_BACKEND?",
        "NPC_BRIDGE_NOTHING_LIKE_ANYTHING is not a setting",
    ]


def test_real_names_that_are_not_settings_are_not_typos(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "bridge.toml"
    config.write_text("", encoding="utf-8")
    for name, value in {
        "NPC_BRIDGE_CONFIG": str(config),
        "NPC_BRIDGE_WORLD_TOKEN_FILE": "/nowhere",
        "NPC_BRIDGE_WORLD_TOKEN": "t",
        "NPC_BRIDGE_BANNED_WORDS": "x",
        "NPC_BRIDGE_LLM_CONTEXT_TOKENS": "4096",
    }.items():
        monkeypatch.setenv(name, value)
    assert typo_warnings() == []


def test_token_comes_from_the_systemd_credential_when_no_variable_names_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "world-token").write_text("credential-token\n", encoding="utf-8")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    assert load_settings().require_token() == "credential-token"
    other = tmp_path / "file"
    other.write_text("file-token", encoding="utf-8")
    monkeypatch.setenv("NPC_BRIDGE_WORLD_TOKEN_FILE", str(other))
    assert load_settings().require_token() == "file-token"
    monkeypatch.setenv("NPC_BRIDGE_WORLD_TOKEN", "env-token")
    assert load_settings().require_token() == "env-token"


def test_a_credentials_directory_without_the_token_is_no_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    with pytest.raises(ConfigError, match=r"^NPC_BRIDGE_WORLD_TOKEN: required .*credential world-token"):
        load_settings().require_token()


def test_unreadable_config_file_is_one_line_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPC_BRIDGE_CONFIG", str(tmp_path))  # a directory
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert str(caught.value) == f"NPC_BRIDGE_CONFIG: cannot read {tmp_path}: Is a directory"


def test_bad_value_in_toml_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "bridge.toml"
    config.write_text("llm_concurrency = 0\n", encoding="utf-8")
    monkeypatch.setenv("NPC_BRIDGE_CONFIG", str(config))
    with pytest.raises(ConfigError, match=r"^NPC_BRIDGE_LLM_CONCURRENCY: "):
        load_settings()


def test_word_lists_are_comma_separated_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPC_BRIDGE_MEMORY_MOOD_WORDS", "疲れ, 眠い ,")
    monkeypatch.setenv("NPC_BRIDGE_BANNED_WORDS", "ばか")
    s = load_settings()
    assert s.memory_mood_words == ("疲れ", "眠い")
    assert s.banned_words == ("ばか",)


def test_token_value_never_appears_in_a_validation_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPC_BRIDGE_WORLD_TOKEN", "tok-s3cret")
    monkeypatch.setenv("NPC_BRIDGE_LLM_CONCURRENCY", "x")
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert "tok-s3cret" not in str(caught.value)
